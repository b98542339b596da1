"""`odc.plan`: load-balancing plans computed by the C++ planner (through the C API), and
`odc.steal_span`: one minibatch run with work stealing, simulated by the same C++ code.

The returned plan is exactly the JSON document of `odc plan` (docs/planner.md).
"""

from __future__ import annotations

import ctypes
import json
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

from . import _capi
from .errors import InvalidArgument

_COST_MESSAGE = (
    "expected three comma-separated non-negative numbers A,B,C (and optionally a floor F: "
    "A,B,C,F)"
)


# ctypes keeps the low 64 bits of a larger integer without a word (2**70 becomes 0): check first.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _lengths_array(lengths: Sequence[int]) -> "ctypes.Array[ctypes.c_int64]":
    values = []
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise InvalidArgument(f"sample {index}: length must be an integer, got {length!r}")
        if not _INT64_MIN <= int(length) <= _INT64_MAX:
            raise InvalidArgument(f"sample {index}: length {int(length)} does not fit in 64 bits")
        values.append(int(length))
    return (ctypes.c_int64 * len(values))(*values)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if not _INT64_MIN <= int(value) <= _INT64_MAX:
        raise InvalidArgument(f"{name} must fit in 64 bits, got {int(value)}")
    return int(value)


# `odc plan --samples-per-rank`'s default (src/simulate/sweep.h, SampleSelection): the same here.
DEFAULT_SAMPLES_PER_RANK = 4


def _samples_per_minibatch(
    num_ranks: int, samples_per_rank: Optional[int], minibatch_size: Optional[int]
) -> int:
    """Consecutive samples per minibatch, as `odc plan` derives it: ranks x samples_per_rank
    (None: every sample in one minibatch); the deprecated minibatch_size gives it directly."""
    if minibatch_size is not None:
        if samples_per_rank != DEFAULT_SAMPLES_PER_RANK:
            raise InvalidArgument(
                "pass samples_per_rank or the deprecated minibatch_size, not both: "
                "drop minibatch_size"
            )
        warnings.warn(
            "odc.plan(minibatch_size=...) is deprecated: pass samples_per_rank (a minibatch is "
            "ranks x samples_per_rank consecutive samples, as `odc plan --samples-per-rank`), or "
            "samples_per_rank=None for all samples in one minibatch",
            DeprecationWarning,
            stacklevel=3,
        )
        return _integer("minibatch_size", minibatch_size)
    if samples_per_rank is None:
        return _capi.ODC_PLAN_ALL_SAMPLES
    per_rank = _integer("samples_per_rank", samples_per_rank)
    if per_rank < 1:
        raise InvalidArgument(
            f"samples_per_rank must be >= 1, got {per_rank} (None: all samples in one minibatch)"
        )
    if num_ranks < 1:
        return 1  # the planner refuses the rank count itself, in its own words
    # More samples than any list holds plans everything as one minibatch, as the CLI does.
    return min(num_ranks * per_rank, _capi.ODC_PLAN_ALL_SAMPLES)


def plan(
    lengths: Sequence[int],
    ranks: int,
    max_tokens: int,
    policy: str,
    *,
    samples_per_rank: Optional[int] = DEFAULT_SAMPLES_PER_RANK,
    cost: Sequence[float] = (1.0, 0.0, 0.0),
    rank_speed: Optional[Sequence[float]] = None,
    split: str = "off",
    split_exchange: Optional[float] = None,
    microbatch_memory: str = "lb-micro",
    steal: bool = False,
    minibatch_size: Optional[int] = None,
) -> dict:
    """Plans microbatches for every rank and predicts the bubble (docs/design.md, "Load
    balancing: exact definitions").

    lengths: tokens per sample, in order; consecutive groups of ranks x `samples_per_rank`
        form the minibatches (the last one may be short), as `odc plan --samples-per-rank`,
        with the same default (4): the same file gives the same plan and bubble both ways.
    samples_per_rank: samples per rank per minibatch; None: all `lengths` are one minibatch
        (a training step planning the minibatch it holds, whatever its size).
    policy: "local-sort", "lb-micro" or "lb-mini".
    cost: (a, b, c) or (a, b, c, floor): a microbatch costs max(floor, c + sum(a*L + b*L^2));
        floor (default 0) is the least time any microbatch takes (docs/planner.md, "Cost
        model").
    rank_speed: relative speed of each rank (heterogeneous GPUs); LB-Mini balances cost / speed.
    split: "off" or "auto": a sample costing more than its minibatch's ideal per-rank share runs
        as context-parallel chunks on a group of ranks when that lowers the predicted span
        (lb-mini and lb-micro; docs/planner.md, "Splitting outliers"). Each minibatch then has
        "splits": [{"sample", "ranks", "chunks", "chunk_costs"}], and those samples are in no
        rank's microbatches.
    split_exchange: K/V exchange cost per token a chunk receives, as a fraction of a (default
        0.05).
    microbatch_memory: how large LB-Mini may make a microbatch (activation memory follows its
        tokens): "lb-micro" (default) keeps every LB-Mini microbatch within the largest one
        LB-Micro builds for the same minibatch, so ODC + LB-Mini needs no more activation memory
        than collective + LB-Micro; "cap" fills up to max_tokens (the fastest predicted plan).
        Other policies ignore it (docs/planner.md, "Microbatch memory").
    steal: also predict every minibatch under ODC with work stealing (docs/planner.md, "Work
        stealing"): each minibatch gains "steal": {"time", "odc_time", "busy", "bubble", "moved"}
        and the root "steal": {"time", "odc_time", "bubble", "moved"} (times summed over
        minibatches, the bubble weighted by time). The plan itself is the same.
    minibatch_size: deprecated (DeprecationWarning): samples per minibatch, whatever the rank
        count (`odc plan --minibatch-size`); use samples_per_rank.
    Everything after `policy` is keyword-only: the fifth positional argument used to be
    minibatch_size, and is refused rather than read as samples_per_rank.

    Returns {"policy", "ranks", "max_tokens", "cost", "minibatches", "bubble"} as dicts and lists.
    Raises odc.InvalidArgument (a ValueError), with the same message as the CLI, for bad
    arguments.
    """
    num_ranks = _integer("ranks", ranks)
    return plan_consecutive(
        lengths,
        num_ranks,
        max_tokens,
        policy,
        samples_per_minibatch=_samples_per_minibatch(num_ranks, samples_per_rank, minibatch_size),
        cost=cost,
        rank_speed=rank_speed,
        split=split,
        split_exchange=split_exchange,
        microbatch_memory=microbatch_memory,
        steal=steal,
    )


def plan_consecutive(
    lengths: Sequence[int],
    ranks: int,
    max_tokens: int,
    policy: str,
    *,
    samples_per_minibatch: int,
    cost: Sequence[float] = (1.0, 0.0, 0.0),
    rank_speed: Optional[Sequence[float]] = None,
    split: str = "off",
    split_exchange: Optional[float] = None,
    microbatch_memory: str = "lb-micro",
    steal: bool = False,
) -> dict:
    """odc.plan with minibatches of exactly `samples_per_minibatch` consecutive samples, whatever
    the rank count (ODC_PLAN_ALL_SAMPLES: one). For callers whose minibatch is not ranks x a
    count: odc.train's GRPO updates hold prompts x group / K samples. Users call odc.plan."""
    options = _capi.new_plan_options()
    options.num_ranks = _integer("ranks", ranks)
    options.max_tokens = _integer("max_tokens", max_tokens)
    options.minibatch_size = _integer("samples_per_minibatch", samples_per_minibatch)
    if not isinstance(policy, str):
        raise InvalidArgument(f"policy must be a string, got {policy!r}")
    policy_value = ctypes.c_int()
    _capi.check(_capi.lib.odcPolicyFromName(policy.encode(), ctypes.byref(policy_value)))
    options.policy = policy_value.value

    cost_values = tuple(cost) if isinstance(cost, (list, tuple)) else None
    if (
        cost_values is None
        or len(cost_values) not in (3, 4)
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in cost_values)
    ):
        raise InvalidArgument(f"malformed cost {cost!r}: {_COST_MESSAGE}")
    options.cost_a, options.cost_b, options.cost_c = (float(v) for v in cost_values[:3])
    options.cost_floor = float(cost_values[3]) if len(cost_values) == 4 else 0.0

    speeds = None
    if rank_speed is not None:
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in rank_speed):
            raise InvalidArgument(
                f"malformed rank_speed {rank_speed!r}: expected comma-separated positive numbers "
                "S0,S1,..."
            )
        speeds = (ctypes.c_double * len(rank_speed))(*[float(v) for v in rank_speed])
        options.rank_speed = speeds
        options.num_rank_speeds = len(rank_speed)

    if split not in ("off", "auto"):
        raise InvalidArgument(f"unknown split mode {split!r}: expected auto or off")
    options.split = 1 if split == "auto" else 0
    if split_exchange is not None:
        if isinstance(split_exchange, bool) or not isinstance(split_exchange, numbers.Real):
            raise InvalidArgument(f"split_exchange must be a number, got {split_exchange!r}")
        options.split_exchange = float(split_exchange)

    if microbatch_memory not in ("lb-micro", "cap"):
        raise InvalidArgument(
            f"unknown microbatch memory {microbatch_memory!r}: expected lb-micro or cap"
        )
    options.microbatch_memory = 1 if microbatch_memory == "cap" else 0
    if not isinstance(steal, bool):
        raise InvalidArgument(f"steal must be True or False, got {steal!r}")
    options.steal = 1 if steal else 0

    array = _lengths_array(lengths)
    handle = ctypes.c_void_p()
    _capi.check(
        _capi.lib.odcPlanCreate(array, len(array), ctypes.byref(options), ctypes.byref(handle))
    )
    try:
        text = ctypes.c_char_p()
        _capi.check(_capi.lib.odcPlanToJson(handle, ctypes.byref(text)))
        return json.loads(text.value)
    finally:
        _capi.lib.odcPlanDestroy(handle)


def read_lengths(path: str) -> List[int]:
    """A lengths file in the `odc plan` format, read by the same C++ code (same errors)."""
    values = ctypes.POINTER(ctypes.c_int64)()
    count = ctypes.c_size_t()
    _capi.check(
        _capi.lib.odcLengthsRead(str(path).encode(), ctypes.byref(values), ctypes.byref(count))
    )
    try:
        return [int(values[i]) for i in range(count.value)]
    finally:
        _capi.lib.odcLengthsFree(values)


@dataclass(frozen=True)
class StealResult:
    """One minibatch run with work stealing (odc.steal_span)."""

    span: float  # when the last rank finishes
    finish: List[float]  # per rank: the end of its last item (its start if it ran none)
    busy: List[float]  # per rank: time spent on items
    runner: List[List[int]]  # runner[q][i]: the rank that ran item i of queue q
    moved: int  # items run by a rank other than their queue's owner

    @property
    def bubble(self) -> float:
        """1 - sum(busy) / (N * span); 0 when nothing runs."""
        ranks = len(self.busy)
        return 1.0 - sum(self.busy) / (ranks * self.span) if ranks and self.span > 0 else 0.0


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number, got {value!r}")
    return float(value)


def _per_rank(name: str, values: Optional[Sequence[float]], ranks: int):
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{name} must be a list of one number per rank, got {values!r}")
    if len(values) != ranks:
        raise InvalidArgument(
            f"{name} must have one entry per rank: got {len(values)} for {ranks} ranks"
        )
    return (ctypes.c_double * ranks)(*[_number(f"{name}[{r}]", v) for r, v in enumerate(values)])


def microbatch_cost(samples: Sequence[int], lengths: Sequence[int], cost: Sequence[float]) -> float:
    """One microbatch's predicted cost under the planner's model: max(floor, c + sum over its
    samples of (a*L + b*L^2)), cost = (a, b, c) or (a, b, c, floor), `lengths` indexed by the
    plan's sample indices (docs/design.md, "Load balancing: exact definitions")."""
    values = tuple(cost) if isinstance(cost, (list, tuple)) else ()
    if len(values) not in (3, 4):
        raise InvalidArgument(f"malformed cost {cost!r}: {_COST_MESSAGE}")
    a, b, c = (_number("cost", v) for v in values[:3])
    floor = _number("cost", values[3]) if len(values) == 4 else 0.0
    return max(floor, c + sum(a * lengths[i] + b * lengths[i] * lengths[i] for i in samples))


def steal_minibatch(
    minibatch: dict,
    lengths: Sequence[int],
    cost: Sequence[float] = (1.0, 0.0, 0.0),
    rank_speed: Optional[Sequence[float]] = None,
    actual: Optional[Sequence[Sequence[float]]] = None,
) -> StealResult:
    """steal_span on one minibatch of an odc.plan document ({"ranks": [{"microbatches": ...}],
    optional "splits"}), as the planner predicts it with steal=True: queue r is rank r's
    microbatches, each predicted at max(floor, c + sum(a*L + b*L^2)) of its samples' `lengths`
    (the plan's global indices); a split group's members start when its slowest chunk ends
    (chunk_cost / speed). `rank_speed`: the speeds the ranks run at (the plan's, or measured);
    `actual`: measured costs per rank's microbatch, as steal_span takes them. Busy excludes the
    split chunks."""
    if not isinstance(minibatch, dict) or "ranks" not in minibatch:
        raise InvalidArgument('minibatch must be one entry of a plan\'s "minibatches"')
    queues = [
        [microbatch_cost(microbatch, lengths, cost) for microbatch in rank["microbatches"]]
        for rank in minibatch["ranks"]
    ]
    ranks = len(queues)
    speeds = [1.0] * ranks if rank_speed is None else list(rank_speed)
    start = [0.0] * ranks
    for split in minibatch.get("splits", []):
        if len(speeds) != ranks:
            break  # steal_span names the mismatch
        slowest = max(cost / speeds[r] for r, cost in zip(split["ranks"], split["chunk_costs"]))
        for r in split["ranks"]:
            start[r] = slowest
    return steal_span(queues, actual=actual, rank_speed=rank_speed, rank_start=start)


def steal_span(
    queues: Sequence[Union[int, Sequence[float]]],
    actual: Optional[Sequence[Sequence[float]]] = None,
    rank_speed: Optional[Sequence[float]] = None,
    rank_start: Optional[Sequence[float]] = None,
) -> StealResult:
    """Simulates one minibatch with work stealing, the rule the runtime's work board follows
    (docs/planner.md, "Work stealing"): a free rank takes the front of its own queue while it has
    items, then the tail of the queue with the largest sum of unclaimed predicted costs (ties: the
    lowest rank); simultaneous ranks are served in rank order.

    queues: per rank, its microbatches' predicted costs in plan order (e.g. a plan's microbatch
        costs), or per rank a count of microbatches that all cost 1.0 (the board's default).
    actual: per rank, the actual cost of each of its queue's items (same shape); default: the
        predicted ones. An item lasts actual / rank_speed of the rank that runs it.
    rank_speed: relative speed of each rank (> 0); default all 1. A rank 1.3x slower: 1 / 1.3.
    rank_start: when each rank starts taking items (>= 0; e.g. after a split chunk); default 0.

    Raises odc.InvalidArgument naming the input at fault."""
    if isinstance(queues, (str, bytes)) or not isinstance(queues, Sequence):
        raise InvalidArgument(f"queues must be a list with one entry per rank, got {queues!r}")
    ranks = len(queues)
    counts, predicted = [], []
    for r, queue in enumerate(queues):
        if isinstance(queue, numbers.Integral) and not isinstance(queue, bool):
            counts.append(_integer(f"queues[{r}]", queue))
            predicted.extend([1.0] * max(0, int(queue)))
        elif isinstance(queue, Sequence) and not isinstance(queue, (str, bytes)):
            counts.append(len(queue))
            predicted.extend(_number(f"queues[{r}][{i}]", c) for i, c in enumerate(queue))
        else:
            raise InvalidArgument(
                f"queues[{r}] must be a count or a list of predicted costs, got {queue!r}"
            )
    actual_array = None
    if actual is not None:
        if isinstance(actual, (str, bytes)) or not isinstance(actual, Sequence):
            raise InvalidArgument(f"actual must be a list of per-rank cost lists, got {actual!r}")
        if len(actual) != ranks:
            raise InvalidArgument(
                f"actual must have one list per rank: got {len(actual)} for {ranks} ranks"
            )
        flat = []
        for r, (queue_actual, count) in enumerate(zip(actual, counts)):
            if not isinstance(queue_actual, Sequence) or len(queue_actual) != count:
                raise InvalidArgument(
                    f"actual[{r}] must hold one cost per item of queue {r} ({count}), got "
                    f"{queue_actual!r}"
                )
            flat.extend(_number(f"actual[{r}][{i}]", c) for i, c in enumerate(queue_actual))
        actual_array = (ctypes.c_double * len(flat))(*flat)
    speeds = _per_rank("rank_speed", rank_speed, ranks)
    starts = _per_rank("rank_start", rank_start, ranks)
    num_items = len(predicted)
    span = ctypes.c_double()
    moved = ctypes.c_int64()
    finish = (ctypes.c_double * max(1, ranks))()
    busy = (ctypes.c_double * max(1, ranks))()
    runner = (ctypes.c_int64 * max(1, num_items))()
    _capi.check(
        _capi.lib.odcStealSimulate(
            ranks,
            (ctypes.c_int64 * max(1, ranks))(*counts),
            (ctypes.c_double * max(1, num_items))(*predicted),
            actual_array,
            speeds,
            starts,
            ctypes.byref(span),
            finish,
            busy,
            runner,
            ctypes.byref(moved),
        )
    )
    runners, first = [], 0
    for count in counts:
        runners.append([int(runner[first + i]) for i in range(count)])
        first += count
    return StealResult(
        span=span.value,
        finish=[finish[r] for r in range(ranks)],
        busy=[busy[r] for r in range(ranks)],
        runner=runners,
        moved=int(moved.value),
    )
