"""Measured metrics of a training run: per-rank busy and idle time, the measured bubble (the same
definition as the planner's prediction, design.md, with measured times), throughput.

busy[r]  = time rank r spent computing its microbatches (forward + backward, timed on the device)
span     = wall time of the minibatch on the slowest rank (begin to the end of the optimizer step)
bubble   = 1 - sum(busy) / (N * span); over several minibatches 1 - sum(busy) / (N * sum(span))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence


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
        raise ValueError("no minibatches were timed")
    ranks = len(timings[0].busy_seconds)
    if any(len(t.busy_seconds) != ranks for t in timings):
        raise ValueError("every minibatch needs one busy time per rank")
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
