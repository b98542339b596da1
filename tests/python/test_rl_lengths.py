"""The shipped GRPO rollout lengths (data/grpo_math_like.{tsv,txt}): shaped like
published math-RL traces, reproducible from data/generate_lengths.py, readable by the planner."""

import importlib.util
import statistics
from pathlib import Path

import odc

DATA = Path(__file__).resolve().parents[2] / "data"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_lengths", DATA / "generate_lengths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows():
    lines = (DATA / "grpo_math_like.tsv").read_text().splitlines()
    return [tuple(int(v) for v in line.split()) for line in lines if not line.startswith("#")]


def test_shipped_file_is_the_generators_output():
    assert _rows() == _generator().generate_grpo()
    totals = odc.read_lengths(str(DATA / "grpo_math_like.txt"))
    assert totals == [p + r for _, p, r in _rows()]


def test_shape_of_math_rl_rollouts():
    rows = _rows()
    responses = [r for _, _, r in rows]
    assert len(rows) == 10_000
    assert 9_100 <= statistics.mean(responses) <= 10_100  # published: ~9.6K
    assert 5_300 <= statistics.pstdev(responses) <= 6_500  # published: ~5.9K
    assert 0.01 <= sum(r == 20_000 for r in responses) / len(rows) <= 0.06  # hit the cap
    assert all(100 <= p <= 300 for _, p, _ in rows)
    # G = 8 responses per prompt, one prompt length per group, correlated lengths: the spread
    # inside a group is well below the spread of all responses.
    groups = {}
    for group, prompt, response in rows:
        groups.setdefault(group, (prompt, []))[1].append(response)
    assert all(len(r) == 8 for _, r in groups.values())
    assert len({p for p, _ in groups.values()}) > 100  # prompts of many lengths
    within = statistics.mean(statistics.pvariance(r) for _, r in groups.values())
    assert within < 0.7 * statistics.pvariance(responses)
    # Modes near 5K, 9K, 13K and 18K: each holds a local share of the histogram.
    histogram = [sum(lo <= r < lo + 1_000 for r in responses) for lo in range(0, 20_000, 1_000)]
    for mode in (5, 18):
        assert histogram[mode] > histogram[mode - 2] or histogram[mode] > histogram[mode + 1]
