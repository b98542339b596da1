"""The simulator against every training run recorded in docs/results (dev/analysis/validate_runs.py:
predicted against measured step time, mean absolute error <= 5%), through the C API."""

import importlib.util
import json
from pathlib import Path

import pytest

from odc.simulate import simulate as simulate_in_process

REPO = Path(__file__).resolve().parents[2]
# The simulator's accuracy target: mean |predicted - measured| / measured step time.
MEAN_ABSOLUTE_ERROR_BOUND = 0.05


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
    # The 19 runs of the first validation (docs/benchmarks-archive.md, "Predicted against
    # measured, on one basis"), plus any recorded since.
    assert len(rows) >= 19
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


def test_validation_of_the_fsdp2_arms_and_grpo_runs():
    """The five arms of the baselines comparison, RL per RL step and SFT, two runs each on
    4 H100s: every run simulated, the same mean bound (docs/benchmarks-archive.md, fifteenth
    round: 4.40%)."""
    validate_runs = _validate_runs()
    rows = validate_runs.validate(REPO / "docs" / "results" / "baselines_4xh100", repo=REPO)
    assert not [r for r in rows if "skipped" in r]
    assert {(r["comm"], r["policy"]) for r in rows} == {
        ("collective", "lb-micro"), ("fsdp2-deferred", "lb-micro"),
        ("fsdp2-unsharded", "lb-mini"), ("collective", "lb-mini-padded"), ("odc", "lb-mini"),
    }  # fmt: skip
    assert sum(r.get("task") == "grpo" for r in rows) == 10
    mean = sum(abs(r["error"]) for r in rows) / len(rows)
    assert mean <= MEAN_ABSOLUTE_ERROR_BOUND, rows


def test_validation_of_the_packed_rung_calibration_runs():
    """The second GRPO configuration (2 prompts x 8 responses, K = 1) and SFT with the
    cost fitted with packed rungs, 4 H100s (docs/benchmarks-archive.md, seventeenth round): every
    run of the five arms within 5% of its measured seconds per step (RL: per RL step)."""
    validate_runs = _validate_runs()
    rows = validate_runs.validate(REPO / "docs" / "results" / "grpo_k1_4xh100", repo=REPO)
    assert not [r for r in rows if "skipped" in r]
    assert len(rows) == 10 and sum(r.get("task") == "grpo" for r in rows) == 5
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= 0.05, worst


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


def _sft_run(comm: str, policy: str, lengths: list) -> dict:
    """A results entry as odc.train writes it (summary.py), cut to what validate_runs reads."""
    return {
        "comm": comm, "policy": policy, "preset": "tiny", "cost": [1e-3, 0.0, 0.01],
        "ranks": 2, "samples_per_rank": 4, "steps_measured": 2, "max_tokens": 512,
        "microbatch_memory": "lb-micro", "device": "cuda", "split": "off",
        "step_seconds": 1.0, "measured_lengths": lengths,
    }  # fmt: skip


def test_the_new_arms_and_grpo_runs_are_validated(tmp_path):
    validate_runs = _validate_runs()
    lengths = [100, 400, 250, 30, 60, 480, 200, 90, 310, 120, 20, 440, 75, 150, 260, 35]
    runs = [
        _sft_run("fsdp2-deferred", "lb-micro", lengths),
        _sft_run("fsdp2-unsharded", "lb-mini", lengths),
        _sft_run("collective", "lb-mini-padded", lengths),
        # odc.train runs it; the simulator has no such arm (padding buys odc nothing): listed.
        _sft_run("odc", "lb-mini-padded", lengths),
    ]
    # GRPO: 2 ranks, K = 2 updates per RL step of 8 rollouts, one warm-up RL step (2 update
    # minibatches), 2 measured RL steps; phase_seconds holds the warm-up's entry first.
    grpo = _sft_run("odc", "lb-mini", lengths)
    grpo.update(task="grpo", steps_measured=4, warmup_steps=2)
    grpo["minibatch_seconds"] = [0.5, 0.25, 0.5, 0.75]
    grpo["rl"] = {
        "minibatches_per_step": 2,
        "phase_seconds": [
            {"old_logprobs": 9.0, "old_logprobs_exchange": 9.0, "ref_logprobs": 9.0},  # warm-up
            {"old_logprobs": 0.25, "old_logprobs_exchange": 5.0, "ref_logprobs": 0.25},
            {"old_logprobs": 0.5, "old_logprobs_exchange": 5.0, "ref_logprobs": 0.25},
        ],
    }
    results = tmp_path / "docs"
    results.mkdir()
    (results / "arms.json").write_text(json.dumps(runs + [grpo]))
    rows = validate_runs.validate(results, repo=tmp_path)
    skipped = [r for r in rows if "skipped" in r]
    assert [(r["comm"], r["policy"]) for r in skipped] == [("odc", "lb-mini-padded")]
    assert skipped[0]["skipped"].startswith("not simulated: ")
    by_arm = {(r["comm"], r["policy"]): r for r in rows}
    # Each FSDP2 arm is simulated as its own mode: the same figure odc simulate gives for it.
    for comm, policy in (("fsdp2-deferred", "lb-micro"), ("fsdp2-unsharded", "lb-mini")):
        run = _sft_run(comm, policy, lengths)
        arguments = [
            "--model", "tiny", "--cost", "0.001,0,0.01", "--ranks", "2", "--samples-per-rank",
            "4", "--minibatches", "2", "--max-tokens", "512", "--policies", policy, "--modes",
            comm, "--gpus-per-node", "2", "--cost-calibrated-on", "2", "--microbatch-memory",
            "lb-micro",
        ]  # fmt: skip
        (expected,) = simulate_in_process(arguments, lengths)["results"]
        # validate_runs builds the typed request: the same document as the command's options.
        assert validate_runs.sweep(lengths, **validate_runs.simulate_options(run, None)) == (
            simulate_in_process(arguments, lengths)
        )
        assert expected["mode"] == comm
        assert by_arm[(comm, policy)]["simulated_step_seconds"] == expected["step_seconds"]
    assert by_arm[("collective", "lb-mini-padded")]["simulated_step_seconds"] > 0
    # GRPO per RL step, the warm-up and the log-prob exchanges left out: forward phases
    # (0.5 + 0.75) / 2, updates (0.75 + 1.25) / 2.
    row = by_arm[("odc", "lb-mini")]
    assert row["task"] == "grpo" and row["minibatches"] == 2
    assert row["measured_forward_seconds"] == pytest.approx(0.625)
    assert row["measured_update_seconds"] == pytest.approx(1.0)
    assert row["measured_step_seconds"] == pytest.approx(1.625)
    assert row["simulated_step_seconds"] == pytest.approx(
        row["simulated_forward_seconds"] + row["simulated_update_seconds"]
    )
    assert row["error"] == pytest.approx(row["simulated_step_seconds"] / 1.625 - 1)
    # An RL step that is not N x samples-per-rank rollouts is listed, not dropped.
    grpo["ranks"] = 3
    (results / "arms.json").write_text(json.dumps([grpo]))
    (row,) = validate_runs.validate(results, repo=tmp_path)
    assert row["skipped"].startswith("not simulated: an RL step of 8 rollouts")
