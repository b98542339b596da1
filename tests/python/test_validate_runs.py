"""The simulator against every training run recorded in docs/results (dev/analysis/validate_runs.py:
predicted against measured step time, mean absolute error <= 5%), through the C API."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEAN_ABSOLUTE_ERROR_BOUND = 0.05  # issue #15


def _validate_runs():
    path = REPO / "dev" / "analysis" / "validate_runs.py"
    spec = importlib.util.spec_from_file_location("validate_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_against_recorded_runs(capsys):
    validate_runs = _validate_runs()
    all_rows = validate_runs.validate(REPO / "docs" / "results")
    # Every recorded run (1.5b and 7b, all policies run, HSDP meshes) is simulated, except runs
    # with split samples, which are listed as not simulated (never dropped silently).
    skipped = [r for r in all_rows if "skipped" in r]
    rows = [r for r in all_rows if "skipped" not in r]
    assert skipped and all(r["policy"].endswith("+split") for r in skipped)
    assert len(rows) >= 19  # the 19 runs of issue #15's validation, plus any recorded since
    assert {(r["comm"], r["policy"]) for r in rows} == {
        ("collective", "local-sort"), ("collective", "lb-micro"),
        ("odc", "local-sort"), ("odc", "lb-micro"), ("odc", "lb-mini"),
    }  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    mean = sum(errors) / len(errors)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"mean absolute error {mean:.2%}, worst {worst['error']:+.2%} ({worst['file']})")
    assert mean <= MEAN_ABSOLUTE_ERROR_BOUND, rows
    # The command line prints the same rows and the summary.
    capsys.readouterr()
    assert validate_runs.main([str(REPO / "docs" / "results")]) == 0
    printed = capsys.readouterr().out
    assert f"over {len(rows)} runs" in printed and f"{len(skipped)} runs not simulated" in printed


def test_validation_with_measured_transport_curves():
    validate_runs = _validate_runs()
    curves = str(REPO / "data" / "transport" / "h200x4_odc_bench.json")
    rows = validate_runs.validate(REPO / "docs" / "results", transport=curves)
    rows = [r for r in rows if "skipped" not in r]
    assert len(rows) >= 19
    mean = sum(abs(r["error"]) for r in rows) / len(rows)
    assert mean <= MEAN_ABSOLUTE_ERROR_BOUND, rows


def test_a_run_it_cannot_place_is_named(tmp_path):
    validate_runs = _validate_runs()
    run = {"comm": "odc", "policy": "lb-mini", "ranks": 2, "samples_per_rank": 2}
    run.update(steps_measured=1, step_seconds=1.0)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "unknown.json").write_text(json.dumps([run]))
    with pytest.raises(ValueError, match="unknown.json: the run records no measured_lengths"):
        validate_runs.validate(tmp_path / "docs", repo=tmp_path)
