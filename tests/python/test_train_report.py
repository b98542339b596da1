"""`python -m odc.train`'s report from recorded results, no training: its tables keep their
columns aligned whatever the magnitudes (a cost model in the wrong unit, negative errors), a
given --cost far from the measured seconds is called out, and a CPU report leads with what it
checked and says its timings are not GPU figures. Pure formatting: well under a second."""

import re

import pytest

pytest.importorskip("numpy")

from odc.train.__main__ import print_table  # noqa: E402
from odc.train.table import format_table  # noqa: E402


def _result(comm, policy, device, *, span_error, predicted, measured, losses):
    return {
        "comm": comm,
        "policy": policy,
        "device": device,
        "ranks": 4,
        "cost": [1.0, 0.01, 0.0],
        "cost_source": "given",
        "samples_per_second": 12.5,
        "tokens_per_second": 40000.0,
        "minibatch_seconds": [measured, measured * 1.5, measured * 0.9],
        "step_seconds": measured,
        "predicted_seconds": predicted * 3,
        "minibatches": 3,
        "span_error": span_error,
        "bubble": 0.25,
        "predicted_bubble": 0.125,
        "peak_memory_bytes": 3 * 2**30,
        "losses": losses,
        "grad_norms": [1.0, 1.0, 1.0],
        "per_minibatch": [
            {
                "predicted_span_seconds": predicted,
                "measured_span_seconds": m,
                "relative_error": predicted / m - 1.0,
            }
            for m in (measured, measured * 1.5, measured * 0.9)
        ],
    }


def _cell_spans(line):
    """(start, end) of every cell: runs of text separated by two or more spaces."""
    return [match.span() for match in re.finditer(r"\S+(?: \S+)*", line)]


def _assert_aligned(lines, align):
    """Right-aligned columns end at the same offset in every line, left-aligned ones start at
    the same offset, and no two cells touch (two spaces at least between them)."""
    spans = [_cell_spans(line) for line in lines]
    assert len({len(s) for s in spans}) == 1, lines  # no cell ran into its neighbour
    for column, side in enumerate(align):
        edges = {s[column][1] if side == "r" else s[column][0] for s in spans}
        assert len(edges) == 1, (column, lines)


def test_columns_stay_aligned_for_huge_and_negative_values():
    header = ["run", "pred s", "err"]
    rows = [
        ["odc + lb-mini", "1291.645", "+388068.6%"],
        ["collective + lb-micro", "0.001", "-99.9%"],
        ["x", "-123456789.000", "+0.0%"],
    ]
    lines = format_table(header, rows, "lrr")
    _assert_aligned(lines, "lrr")
    assert all(line == line.rstrip() for line in lines)
    with pytest.raises(ValueError, match="one 'l' or 'r' per column"):
        format_table(header, rows, "lr")
    with pytest.raises(ValueError, match="a row has 2 cells for 3 columns"):
        format_table(header, [["a", "b"]], "lrr")


def test_cpu_report_leads_with_its_checks_and_calls_out_a_cost_in_another_unit(capsys):
    # The documented GRPO CPU command once passed --cost 1,0.01,0 (token counts, not seconds):
    # predictions of ~1300 s against ~0.3 s measured, and columns that ran together.
    losses = [10.5, 10.25, 10.0]
    results = [
        _result("collective", "lb-micro", "cpu", span_error=3880.686, predicted=1291.645,
                measured=0.3328, losses=losses),
        _result("odc", "lb-mini", "cpu", span_error=-0.9876, predicted=0.004, measured=0.3242,
                losses=losses),
    ]  # fmt: skip
    print_table(results)
    out = capsys.readouterr().out
    lines = out.splitlines()
    first = next(line for line in lines if line.strip())
    assert first == "what this CPU run checked:"
    checked = out.index("losses: AGREE across the 2 runs")
    assert "timings: NOT GPU figures. The 4 ranks are processes sharing" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("comm "))
    assert checked < out.index(lines[header])
    table = lines[header : header + 3]
    _assert_aligned(table, "llrrrrrrrrl")
    assert "+388068.6%" in table[1] and "-98.8%" in table[2]
    assert "note: the given --cost predicts 3.88e+03x the measured seconds" in out
    assert "leave --cost out (the default, 'fit'" in out
    start = lines.index("per minibatch, predicted / measured span in seconds (error):")
    _assert_aligned(lines[start + 1 : start + 5], "rrr")


def test_gpu_report_keeps_the_table_first_and_a_good_cost_passes_quietly(capsys):
    losses = [2.5, 2.25]
    results = [
        _result("collective", "lb-micro", "cuda", span_error=0.02, predicted=1.02, measured=1.0,
                losses=losses),
        _result("odc", "lb-mini", "cuda", span_error=-0.03, predicted=0.8, measured=0.82,
                losses=losses),
    ]  # fmt: skip
    print_table(results)
    out = capsys.readouterr().out
    assert "what this CPU run checked" not in out and "NOT GPU figures" not in out
    assert "note: the given --cost" not in out
    assert out.index("comm ") < out.index("losses: AGREE across the 2 runs")
    assert "3.00" in out  # peak GiB is measured on GPUs
