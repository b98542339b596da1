"""A short CPU run of `python -m odc.train` (tiny preset, 2 processes): it finishes and writes
sane metrics, a results file and a timeline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="odc train needs torch")
pytest.importorskip("transformers", reason="odc train needs transformers")

from odc._cost_fit import packed_ladder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_train_compare_runs_and_reports(tmp_path):
    output, timeline = tmp_path / "results.json", tmp_path / "timeline.png"
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(REPO / "data" / "aime_rl_like.txt"),
        "--device", "cpu", "--ranks", "2", "--preset", "tiny", "--length-scale", "0.004",
        "--steps", "2", "--samples-per-rank", "3", "--compare",
        "--output", str(output), "--timeline", str(timeline),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "samples/s" in result.stdout
    runs = json.loads(output.read_text())
    assert [(r["comm"], r["policy"]) for r in runs] == [
        ("collective", "lb-micro"),
        ("odc", "lb-mini"),
    ]
    for run in runs:
        assert run["steps_measured"] == 2
        assert run["samples_per_second"] > 0 and run["tokens_per_second"] > 0
        assert 0.0 <= run["bubble"] < 1.0 and 0.0 <= run["predicted_bubble"] < 1.0
        assert len(run["busy_seconds"]) == 2 and all(b > 0 for b in run["busy_seconds"])
        assert all(loss > 0 for loss in run["losses"])
        assert len(run["timeline"]) == 2
        # Predicted and measured spans, minibatch by minibatch, on the same basis.
        rows = run["per_minibatch"]
        assert len(rows) == 2 and all(r["measured_span_seconds"] > 0 for r in rows)
        assert all(r["predicted_span_seconds"] > 0 for r in rows)
        assert run["predicted_seconds"] == pytest.approx(
            sum(r["predicted_span_seconds"] for r in rows)
        )
        # Where each measured minibatch's tail went, host seconds per call (all ranks' longest).
        assert len(run["tail_phase_seconds"]) == 2
        for phases in run["tail_phase_seconds"]:
            assert set(phases) == {"end", "clip", "step", "zero_grad", "sync"}
            assert all(seconds >= 0 for seconds in phases.values())
            assert sum(phases.values()) <= max(r["measured_span_seconds"] for r in rows) + 1e-3
        assert run["microbatch_memory"] == "lb-micro"
    assert runs[0]["bubble_measured"] is False and runs[1]["bubble_measured"] is True
    # Enough to re-plan and re-simulate the measured minibatches (python -m odc.simulate).
    assert all(len(r["measured_lengths"]) == 2 * 2 * 3 for r in runs)
    assert "n/a" in result.stdout and "per minibatch" in result.stdout
    # One cost model, fitted in the first run and reused by the second.
    assert runs[0]["cost_source"] == "fitted" and len(runs[0]["calibration"]) >= 3
    # The ladder's packed rungs are recorded as [tokens, seconds, documents], after the single
    # ones ([tokens, seconds], the floor's first): calibrate.packed_ladder of the same cap.
    calibration = runs[0]["calibration"]
    packed = [r for r in calibration if len(r) == 3]
    expected = packed_ladder(runs[0]["max_tokens"])
    assert [(r[0], r[2]) for r in packed] == [(sum(p), len(p)) for p in expected]
    assert len(expected) >= 2 and calibration[-len(packed) :] == packed
    assert runs[1]["cost"] == runs[0]["cost"] and runs[1]["calibration"] == []
    # Same data, same initialization, same summed gradients: the same losses step by step.
    assert runs[0]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-4)
    assert timeline.stat().st_size > 1000


def test_train_refuses_lb_mini_under_collectives(tmp_path):
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(REPO / "data" / "aime_rl_like.txt"),
        "--device", "cpu", "--ranks", "2", "--comm", "collective", "--policy", "lb-mini",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert "collective FSDP2 cannot run" in result.stderr


@pytest.mark.long
def test_train_reads_jsonl_token_ids(tmp_path):
    data = tmp_path / "tokens.jsonl"
    data.write_text("\n".join(json.dumps(list(range(n % 50, n % 50 + n))) for n in range(5, 17)))
    command = [
        sys.executable, "-m", "odc.train", "--jsonl", str(data), "--device", "cpu",
        "--ranks", "2", "--preset", "tiny", "--steps", "1", "--samples-per-rank", "2",
        "--output", str(tmp_path / "r.json"), "--timeline", "",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads((tmp_path / "r.json").read_text())
    assert (run["comm"], run["policy"]) == ("odc", "lb-mini") and run["steps_measured"] == 1


def test_train_names_a_bad_lengths_line(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("12\nabc\n")
    command = [sys.executable, "-m", "odc.train", "--lengths", str(lengths), "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert "line 2: expected a positive integer length, got 'abc'" in result.stderr


@pytest.mark.parametrize("cost", ["1,2", "1,-2,0", "a,b,c", "1,nan,0", "1,0,0,-1", "1,0,0,0,0"])
def test_train_names_a_bad_cost(tmp_path, cost):
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(REPO / "data" / "aime_rl_like.txt"),
        "--device", "cpu", "--cost", cost,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert (
        "--cost must be 'fit' or three non-negative numbers A,B,C (or four, A,B,C,F, with a "
        f"floor F), got '{cost}'" in result.stderr
    )


@pytest.mark.long
def test_train_with_a_given_cost_reports_it(tmp_path):
    output = tmp_path / "r.json"
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(REPO / "data" / "aime_rl_like.txt"),
        "--device", "cpu", "--ranks", "2", "--preset", "tiny", "--length-scale", "0.004",
        "--steps", "1", "--samples-per-rank", "2", "--comm", "collective", "--policy",
        "lb-micro", "--cost", "0.001,0.00001,0.01", "--output", str(output), "--timeline", "",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(output.read_text())
    assert run["cost"] == [0.001, 0.00001, 0.01, 0.0] and run["cost_source"] == "given"
    assert run["calibration"] == []
