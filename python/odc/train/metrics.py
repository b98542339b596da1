"""Measured metrics of a training run: per-rank busy and idle time, the measured bubble (the same
definition as the planner's prediction, docs/design.md, "Measuring", with measured times),
throughput.

busy[r]  = time rank r spent computing its microbatches (forward + backward, timed on the device)
span     = wall time of the minibatch on the slowest rank (begin to the end of the optimizer step)
bubble   = 1 - sum(busy) / (N * span); over several minibatches 1 - sum(busy) / (N * sum(span))

The planner's prediction for the same minibatches is put on the same basis (predict_minibatch,
compare_prediction): predicted busy and span per minibatch, the bubble weighted by time, and the
relative error of the predicted span against the measured one, minibatch by minibatch.
Under `collective`, busy includes the waits inside FSDP2's per-layer collectives (they run on the
compute stream's critical path), so the measured bubble there is not idle time: compare spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from ..errors import InvalidArgument
from ..planner import microbatch_cost, steal_minibatch


@dataclass
class MinibatchTiming:
    busy_seconds: List[float]  # per rank
    span_seconds: float  # slowest rank's wall time for the minibatch
    samples: int
    tokens: int
    microbatches: List[int] = field(default_factory=list)  # per rank

    @property
    def bubble(self) -> float:
        ranks = len(self.busy_seconds)
        if self.span_seconds <= 0 or ranks == 0:
            return 0.0
        return 1.0 - sum(self.busy_seconds) / (ranks * self.span_seconds)


def summarize(timings: Sequence[MinibatchTiming]) -> dict:
    """Totals over minibatches: throughput, measured bubble, idle seconds per rank."""
    if not timings:
        raise InvalidArgument("no minibatches were timed")
    ranks = len(timings[0].busy_seconds)
    if any(len(t.busy_seconds) != ranks for t in timings):
        raise InvalidArgument("every minibatch needs one busy time per rank")
    span = sum(t.span_seconds for t in timings)
    busy = [sum(t.busy_seconds[r] for t in timings) for r in range(ranks)]
    samples = sum(t.samples for t in timings)
    tokens = sum(t.tokens for t in timings)
    return {
        "minibatches": len(timings),
        "seconds": span,
        "samples_per_second": samples / span if span > 0 else 0.0,
        "tokens_per_second": tokens / span if span > 0 else 0.0,
        "step_seconds": span / len(timings),
        "busy_seconds": busy,
        "idle_seconds": [span - b for b in busy],
        "bubble": 1.0 - sum(busy) / (ranks * span) if span > 0 else 0.0,
    }


# Prediction on the same basis as the measurement (docs/design.md, "Measuring"): the planner's
# cost model gives each rank's busy time and the minibatch's span under the run's communication
# mode, and the bubble over several minibatches is weighted by time on both sides.


@dataclass
class PredictedTiming:
    busy_seconds: List[float]  # per rank: sum of its microbatches' predicted costs
    span_seconds: float  # collective: sum_k max_r C[r][k]; odc: max_r sum_k C[r][k]


def cost_terms(cost: Sequence[float]) -> tuple:
    """(a, b, c, floor) of a cost model given as (a, b, c) or (a, b, c, floor)."""
    if len(cost) not in (3, 4):
        raise InvalidArgument(f"a cost model is (a, b, c) or (a, b, c, floor), got {tuple(cost)!r}")
    return (*cost, 0.0) if len(cost) == 3 else tuple(cost)


def describe_cost(cost: Sequence[float]) -> str:
    """The cost model as the planner applies it, in seconds per microbatch."""
    a, b, c, floor = cost_terms(cost)
    text = f"{c:.4g} s + {a:.4g} s x L + {b:.4g} s x L^2"
    return f"max({floor:.4g} s, {text})" if floor > 0 else text


def predict_minibatch(
    ranks: Sequence[dict],
    lengths: Sequence[int],
    cost: Sequence[float],
    mode: str,
    splits: Sequence[dict] = (),
) -> PredictedTiming:
    """The planner's time accounting of one minibatch of a plan (`ranks` as in odc.plan's JSON:
    [{"microbatches": [[sample, ...], ...]}, ...]) under mode "collective", "odc" or
    "odc-steal" (ODC with work stealing: the planner's event model of the work board,
    odc.steal_minibatch; busy is then what each rank runs after the claims).

    `splits`: the minibatch's "splits" entries (split samples are in no rank's microbatches). As
    in the planner, a member's first step is its group's chunk, which lasts as long as the
    slowest member's (`chunk_costs`), while its busy time counts its own chunk's cost."""
    if mode not in ("collective", "odc", "odc-steal"):
        raise InvalidArgument(f"mode must be 'collective', 'odc' or 'odc-steal', got {mode!r}")
    if mode == "odc-steal":
        result = steal_minibatch({"ranks": list(ranks), "splits": list(splits)}, lengths, cost)
        busy = list(result.busy)
        for split in splits:
            for rank, own in zip(split["ranks"], split["chunk_costs"]):
                busy[rank] += own
        return PredictedTiming(busy_seconds=busy, span_seconds=result.span)
    steps = [[] for _ in ranks]
    busy = [0.0 for _ in ranks]
    for split in splits:
        slowest = max(split["chunk_costs"])
        for rank, own in zip(split["ranks"], split["chunk_costs"]):
            steps[rank].append(slowest)
            busy[rank] += own
    for r, rank in enumerate(ranks):
        for microbatch in rank["microbatches"]:
            steps[r].append(microbatch_cost(microbatch, lengths, cost))
            busy[r] += steps[r][-1]
    if mode == "odc":
        span = max((sum(s) for s in steps), default=0.0)
    else:
        count = max((len(s) for s in steps), default=0)
        span = sum(max(s[k] if k < len(s) else 0.0 for s in steps) for k in range(count))
    return PredictedTiming(busy_seconds=busy, span_seconds=span)


def _relative_error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0 if measured > 0 else 0.0


def compare_prediction(
    measured: Sequence[MinibatchTiming], predicted: Sequence[PredictedTiming]
) -> dict:
    """Predicted against measured, minibatch by minibatch and in total, both weighted by time:
    bubble = 1 - sum(busy) / (N * sum(span)). relative_error = predicted / measured - 1."""
    if len(measured) != len(predicted) or not measured:
        raise InvalidArgument("need one prediction per measured minibatch, and at least one")
    ranks = len(measured[0].busy_seconds)
    if any(len(p.busy_seconds) != ranks for p in predicted):
        raise InvalidArgument("every prediction needs one busy time per rank")
    rows = []
    for m, p in zip(measured, predicted):
        p_bubble = 1.0 - sum(p.busy_seconds) / (ranks * p.span_seconds) if p.span_seconds else 0.0
        rows.append(
            {
                "predicted_span_seconds": p.span_seconds,
                "measured_span_seconds": m.span_seconds,
                "relative_error": _relative_error(p.span_seconds, m.span_seconds),
                "predicted_bubble": p_bubble,
                "measured_bubble": m.bubble,
            }
        )
    predicted_seconds = sum(p.span_seconds for p in predicted)
    measured_seconds = sum(m.span_seconds for m in measured)
    predicted_busy = sum(sum(p.busy_seconds) for p in predicted)
    errors = [abs(row["relative_error"]) for row in rows]
    return {
        "predicted_bubble": (
            1.0 - predicted_busy / (ranks * predicted_seconds) if predicted_seconds > 0 else 0.0
        ),
        "predicted_seconds": predicted_seconds,
        "span_error": _relative_error(predicted_seconds, measured_seconds),
        "span_error_mean_abs": sum(errors) / len(errors),
        "span_error_worst": max(rows, key=lambda row: abs(row["relative_error"]))["relative_error"],
        "per_minibatch": rows,
    }
