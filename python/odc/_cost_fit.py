"""Fitting the planner's cost model to measured microbatch times.

The planner balances cost(microbatch) = max(floor, c + sum(a*L + b*L^2)) (docs/design.md). Its
plans, and the bubble it predicts, are only as good as a, b, c and the floor: attention kernels,
masks, activation checkpointing and the loss all change them. `odc train` therefore times
single-sample microbatches of a ladder of lengths on the model it is about to train, a few
packed ones, plus one short one for the floor, and fits the model here.

Why packed rungs: on single samples the a*L and b*L^2 columns rise together, so a noisy ladder
trades one for the other at no cost to its own fit, and a packed microbatch (T tokens, sum of
L_i^2 much less than T^2) then comes out too cheap (4 H100s, 1.5b preset: 32K-58K-token packed
microbatches 5-20% under; docs/benchmarks-archive.md, fifteenth round). The two longest rungs split
into PACKED_SPLITS equal documents keep T and cut sum L^2 by 4x and 16x, which separates a from b
(dev/analysis/packed_rungs.py checks it on the measured microbatches).

The floor is the time of a microbatch that carries almost nothing: the host launching a
training step's kernels (framework hooks, autograd, per-layer communication calls) takes a
fixed time, and a short microbatch runs at the host's pace, not the GPU's (4 H200s, 1.5b preset:
~0.3 s, where c + a L + b L^2 fitted on 2K-64K microbatches said 0.1 s for 1K tokens;
docs/benchmarks-archive.md, seventh round). Rungs that are close to the floor say more about the
host than about a, b and c, so the fit leaves them out.
"""

from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple, Union

import numpy as np

from .errors import InvalidArgument

MIN_FIT_TOKENS = 8  # below this there are too few distinct lengths to fit three terms
FLOOR_TOKENS = 256  # the floor's microbatch: short enough that no GPU work shows
# Rungs faster than this multiple of the floor are mostly host time: left out of the a, b, c fit
# (when at least three rungs remain).
FLOOR_BOUND_RATIO = 1.5
# Packed rungs: each of the PACKED_FROM longest ladder lengths again as PACKED_SPLITS[i] equal
# documents (a split is left out where its documents would be shorter than MIN_DOCUMENT_TOKENS).
PACKED_FROM = 2
PACKED_SPLITS = (4, 16)
MIN_DOCUMENT_TOKENS = 2

# A rung: one sample's length, or the lengths of the documents packed into one microbatch.
RungLengths = Union[int, Sequence[int]]


def ladder(max_tokens: int, rungs: int = 7) -> List[int]:
    """Lengths to time: geometric from max_tokens/32 (but at least min(16, max_tokens/4)) up to
    max_tokens; at least three distinct lengths."""
    if max_tokens < MIN_FIT_TOKENS:
        raise InvalidArgument(f"max_tokens must be at least {MIN_FIT_TOKENS} to fit a cost model")
    start = max(max_tokens / 32, min(16, max_tokens / 4))
    lengths = np.geomspace(start, max_tokens, rungs)
    return sorted({min(max_tokens, max(2, int(round(n)))) for n in lengths})


def split_evenly(tokens: int, documents: int) -> List[int]:
    """`tokens` as `documents` lengths that differ by at most one, longest first."""
    base, extra = divmod(int(tokens), int(documents))
    return [base + 1] * extra + [base] * (documents - extra)


def packed_ladder(max_tokens: int) -> List[List[int]]:
    """The packed rungs: each of the PACKED_FROM longest lengths of ladder(max_tokens) split
    into k equal documents for each k of PACKED_SPLITS (same tokens as the single rung, sum of
    L^2 k times smaller), those with documents of at least MIN_DOCUMENT_TOKENS."""
    rungs = []
    for tokens in ladder(max_tokens)[-PACKED_FROM:]:
        for documents in PACKED_SPLITS:
            if tokens // documents >= MIN_DOCUMENT_TOKENS:
                rungs.append(split_evenly(tokens, documents))
    return rungs


def documents_of(rung: RungLengths) -> List[int]:
    """A rung's document lengths: [L] for a single sample."""
    if isinstance(rung, (int, np.integer)):
        return [int(rung)]
    return [int(n) for n in rung]


def floor_length(max_tokens: int) -> int:
    """Tokens of the microbatch timed for the floor: FLOOR_TOKENS, or a quarter of the ladder's
    shortest rung when that is shorter (small CPU runs)."""
    return max(2, min(FLOOR_TOKENS, ladder(max_tokens)[0] // 4))


def fit_cost_with_floor(
    lengths: Sequence[RungLengths], seconds: Sequence[float], floor_seconds: float
) -> Tuple[float, float, float, float]:
    """(a, b, c, floor): the floor as measured (a microbatch of floor_length tokens), a, b, c
    fitted (fit_cost) on the rungs (single lengths or packed documents' lengths) at least
    FLOOR_BOUND_RATIO x the floor, or on every rung when fewer than three are."""
    if not floor_seconds >= 0 or floor_seconds == float("inf"):
        raise InvalidArgument(f"the floor must be a finite non-negative time, got {floor_seconds}")
    chosen = [(lengths[i], seconds[i]) for i in fitted_rungs(seconds, floor_seconds)]
    a, b, c = fit_cost([n for n, _ in chosen], [s for _, s in chosen])
    return a, b, c, float(floor_seconds)


def fitted_rungs(seconds: Sequence[float], floor_seconds: float) -> List[int]:
    """Indices of the rungs fit_cost_with_floor fits a, b, c on: those at least
    FLOOR_BOUND_RATIO x the floor, or every rung when fewer than three are."""
    chosen = [i for i, s in enumerate(seconds) if s >= FLOOR_BOUND_RATIO * floor_seconds]
    return chosen if len(chosen) >= 3 else list(range(len(seconds)))


def fit_cost(
    lengths: Sequence[RungLengths], seconds: Sequence[float]
) -> Tuple[float, float, float]:
    """Non-negative least-squares fit of seconds = c + sum(a*L + b*L^2) over each rung's
    documents (a rung: one length, or a packed microbatch's document lengths); returns (a, b, c),
    the order `odc plan --cost A,B,C` takes. Every subset of the three terms is solved and the
    best fit whose coefficients are all >= 0 wins, so a noisy point cannot make a term negative."""
    rungs = [documents_of(r) for r in lengths]
    y = np.asarray(seconds, dtype=np.float64)
    if y.ndim != 1 or len(rungs) != y.size or y.size < 3:
        raise InvalidArgument(
            "fit_cost needs at least three (length, seconds) pairs of equal count"
        )
    if np.any(y < 0) or any(not r or min(r) <= 0 for r in rungs):
        raise InvalidArgument("fit_cost needs positive lengths and non-negative times")
    tokens = np.array([sum(r) for r in rungs], dtype=np.float64)
    squares = np.array([sum(float(n) * n for n in r) for r in rungs], dtype=np.float64)
    # Columns scaled to unit size so that L^2 (up to ~4e9) does not swamp the solve.
    columns = [tokens, squares, np.ones_like(tokens)]
    scales = [float(np.max(np.abs(c))) or 1.0 for c in columns]
    best, best_residual = (0.0, 0.0, float(np.mean(y))), float("inf")
    for size in (1, 2, 3):
        for subset in itertools.combinations(range(3), size):
            design = np.stack([columns[i] / scales[i] for i in subset], axis=1)
            solution, *_ = np.linalg.lstsq(design, y, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((design @ solution - y) ** 2))
            if residual < best_residual - 1e-15:
                coefficients = [0.0, 0.0, 0.0]
                for i, value in zip(subset, solution):
                    coefficients[i] = float(value) / scales[i]
                best, best_residual = tuple(coefficients), residual
    return best
