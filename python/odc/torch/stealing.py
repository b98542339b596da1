"""Work stealing in a training loop: the microbatches this rank should compute now.

`OdcFSDP.microbatches(plan)` walks the minibatch's work board (docs/torch.md, "Work stealing"):
this rank's own planned microbatches first, front to back; when they are all claimed, the tail
microbatch of the rank with the most predicted work left. Every microbatch of the plan is computed
exactly once, by whichever rank claims it, and its gradients reach their owners whoever computed
them, so the sums are those of the plan without stealing (up to the order of floating-point
additions). The board's claims are atomic at the queue's owner (src/core/work_board.h).
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from typing import Any, Iterator, List, Optional, Sequence

from ..errors import InvalidArgument, InvalidUsage
from ..planner import microbatch_cost

# Microbatches the host may run ahead of its GPU before it claims its next OWN microbatch: a claim
# is a promise to compute soon, so it waits until the GPU has at most this many of this rank's
# microbatches still queued (one: the GPU never waits for the host's claim, and a host far ahead
# of a slow GPU does not claim work that a faster rank would reach first). Once this rank has
# claimed all of its own, the next take (a steal, or "done") waits until its GPU has nothing
# queued: a rank steals when it is free, as the planner's model of the claims assumes
# (docs/planner.md, "Work stealing"); a steal decided a microbatch early could take the victim's
# tail just before the victim reaches it, and end the minibatch later than without stealing.
MICROBATCHES_IN_FLIGHT = 1


def plan_queues(plan: Any, world_size: int) -> List[List[List[int]]]:
    """Every rank's planned microbatches (lists of sample indices) from one minibatch of
    odc.plan's result ({"ranks": [{"microbatches": ...}, ...]}) or from a list per rank."""
    ranks = plan.get("ranks") if isinstance(plan, dict) else plan
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise InvalidArgument(
            "plan: expected one minibatch of odc.plan's result (a dict with 'ranks') or a list "
            f"with every rank's microbatches, got {type(plan).__name__}"
        )
    if len(ranks) != world_size:
        raise InvalidArgument(
            f"plan: {len(ranks)} ranks' microbatches for a communicator of {world_size} ranks "
            "(stealing needs every rank's plan, the same on every rank)"
        )
    queues = []
    for rank, entry in enumerate(ranks):
        microbatches = entry.get("microbatches") if isinstance(entry, dict) else entry
        if isinstance(microbatches, (str, bytes)) or not isinstance(microbatches, Sequence):
            raise InvalidArgument(f"plan: rank {rank}'s microbatches are not a list")
        queue = []
        for index, microbatch in enumerate(microbatches):
            if isinstance(microbatch, (str, bytes)) or not isinstance(microbatch, Sequence):
                raise InvalidArgument(
                    f"plan: rank {rank}'s microbatch {index} is not a list of sample indices"
                )
            queue.append(list(microbatch))
        queues.append(queue)
    return queues


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plan_costs(
    queues: List[List[List[int]]],
    costs: Optional[Sequence[Sequence[float]]],
    lengths: Optional[Sequence[int]],
    cost: Sequence[float],
) -> List[List[float]]:
    """Predicted cost of every planned microbatch: given, from the samples' lengths and the
    planner's cost model (a, b, c[, floor]: docs/planner.md), or 1 each (the board then steals
    by microbatch counts)."""
    if costs is not None:
        if len(costs) != len(queues) or any(len(c) != len(q) for c, q in zip(costs, queues)):
            raise InvalidArgument(
                "costs: expected one predicted cost per planned microbatch, rank by rank "
                f"(shape {[len(q) for q in queues]}), got {[len(c) for c in costs]}"
            )
        values = [[float(v) for v in row] for row in costs]
    elif lengths is not None:
        if len(cost) not in (3, 4) or not all(_is_real(v) for v in cost):
            raise InvalidArgument(f"cost: expected (a, b, c) or (a, b, c, floor), got {cost!r}")
        try:
            values = [[microbatch_cost(mb, lengths, cost) for mb in q] for q in queues]
        except (IndexError, TypeError) as error:
            raise InvalidArgument(
                f"lengths: cannot price the plan's samples ({error}): pass every sample's "
                "length, indexed like the plan's sample indices"
            ) from None
    else:
        return [[1.0] * len(q) for q in queues]
    for rank, row in enumerate(values):
        for index, value in enumerate(row):
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(
                    f"costs: rank {rank}'s microbatch {index} has predicted cost {value} "
                    "(expected a finite number >= 0)"
                )
    return values


class Claimed(list):
    """One microbatch this rank computes: its sample indices (a list), where the plan put it
    (`queue`: the rank that planned it, `index`: its place in that rank's list) and whether this
    rank took it from another rank's queue (`stolen`)."""

    def __init__(self, samples: List[int], queue: int, index: int, stolen: bool):
        super().__init__(samples)
        self.queue = queue
        self.index = index
        self.stolen = stolen


def microbatches(
    engine: Any,
    plan: Any,
    *,
    costs: Optional[Sequence[Sequence[float]]] = None,
    lengths: Optional[Sequence[int]] = None,
    cost: Sequence[float] = (1.0, 0.0, 0.0),
    steal: bool = True,
) -> Iterator[Claimed]:
    """OdcFSDP.microbatches (its docstring is the contract). Checks the arguments and opens the
    work board when called, not at the first iteration: a rank that first runs a split chunk
    opens its queue to thieves at the minibatch's start, as the planner's model of stealing
    assumes (odc.steal_minibatch)."""
    comm = engine.comm
    queues = plan_queues(plan, comm.world_size)
    if not isinstance(steal, bool):
        raise InvalidArgument(f"steal must be True or False, got {steal!r}")
    predicted = plan_costs(queues, costs, lengths, cost)
    if not engine.in_minibatch:
        raise InvalidUsage(
            "microbatches(): outside a minibatch: iterate inside `with engine.minibatch():` "
            "(the work board belongs to the open minibatch)"
        )
    if not steal:
        return _own(queues, comm.rank)
    comm.work_board_open([len(q) for q in queues], predicted)
    return _claims(comm, queues)


def _own(queues: List[List[List[int]]], rank: int) -> Iterator[Claimed]:
    for index, samples in enumerate(queues[rank]):
        yield Claimed(samples, rank, index, stolen=False)


def _claims(comm: Any, queues: List[List[List[int]]]) -> Iterator[Claimed]:
    pace = _GpuPace(comm.device)
    own_left = len(queues[comm.rank])  # of this rank's queue, not yet claimed by this rank
    while True:
        pace.before_claim(MICROBATCHES_IN_FLIGHT if own_left > 0 else 0)
        taken = comm.work_board_take()
        if taken is None:
            return
        queue, index = taken
        own_left -= queue == comm.rank
        yield Claimed(queues[queue][index], queue, index, stolen=queue != comm.rank)
        pace.after_microbatch()


class _GpuPace:
    """Claims follow the GPU, not the host: before a claim, wait until at most `ahead` of this
    rank's microbatches are still queued on its GPU (a host that ran ahead would otherwise
    claim, and so keep from faster ranks, work its GPU reaches late). No-op on the CPU, where a
    microbatch is done when its backward returns."""

    def __init__(self, device: Optional[int]):
        self._events: Optional[deque] = None
        if device is not None:
            import torch

            self._torch = torch
            self._device = torch.device("cuda", device)
            self._events = deque()

    def before_claim(self, ahead: int) -> None:
        if self._events is None:
            return
        while len(self._events) > ahead:
            self._events.popleft().synchronize()

    def after_microbatch(self) -> None:
        if self._events is None:
            return
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self._device))
        self._events.append(event)
