"""GRPO's training phase in odc.train (issue #30) on CPU processes, through the command line:
the forward-only phases, the actor update over K minibatches, ODC + LB-Mini against collective +
LB-Micro on the same rollouts, and the refusals (_check_runs says what is checked)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.train needs torch")
pytest.importorskip("transformers", reason="the packed model needs transformers")


def _rollouts(path, groups=8, group_size=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(groups):
        prompt = int(rng.integers(4, 9))
        rows += [f"{group} {prompt} {int(rng.integers(8, 60))}" for _ in range(group_size)]
    path.write_text("# group prompt_tokens response_tokens\n" + "\n".join(rows) + "\n")
    return path


def test_cli_task_grpo_runs_every_arm_and_refuses_what_it_cannot_run(tmp_path):
    import json
    import subprocess
    import sys

    path = _rollouts(tmp_path / "rollouts.tsv")
    base = [sys.executable, "-m", "odc.train", "--preset", "tiny", "--device", "cpu",
            "--ranks", "3", "--cost", "1,0.01,0"]  # fmt: skip
    for extra, fault in (
        (["--task", "grpo", "--lengths", str(path)], "--task grpo reads --rollouts"),
        (["--rollouts", str(path)], "--task grpo reads --rollouts"),
        (["--task", "grpo", "--rollouts", str(path), "--split", "auto"], "drop --split"),
        (["--task", "grpo", "--rollouts", str(path), "--prompts-per-step", "3"], "multiple of"),
    ):
        result = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and fault in result.stderr, (extra, result.stderr)
    # The five arms of --baselines on 3 ranks (LB-Mini leaves counts unequal there; the padded
    # and unsharded arms pad): the same losses, entropies and gradient norms in every arm.
    output = tmp_path / "results.json"
    command = base + ["--task", "grpo", "--rollouts", str(path), "--prompts-per-step", "4",
                      "--steps", "1", "--baselines", "--kl-coef", "0.05", "--output", str(output),
                      "--timeline", ""]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GRPO forward-only phases per RL step" in result.stdout
    assert "losses: AGREE across the 5 runs" in result.stdout
    runs = json.loads(output.read_text())
    assert [(r["comm"], r["policy"], r["task"]) for r in runs] == [
        ("collective", "lb-micro", "grpo"),
        ("fsdp2-deferred", "lb-micro", "grpo"),
        ("fsdp2-unsharded", "lb-mini", "grpo"),
        ("collective", "lb-mini-padded", "grpo"),
        ("odc", "lb-mini", "grpo"),
    ]
    _check_runs(runs, path)
    padded = runs[3]["microbatch_log"]
    assert any(m.get("lengths") == [] for mb in padded for rank in mb for m in rank)
    # fsdp2-unsharded: one all-gather per FSDP2 unit per update minibatch (the forward-only
    # phases gather outside the counted minibatches), one reduce-scatter per unit.
    units = runs[2]["fsdp2_collectives"][0][0]
    assert units["all_gather"] == units["reduce_scatter"] > 0


def _check_runs(runs, path):
    """Every arm on the same rollouts: the same arithmetic, so the same losses, gradient norms
    and entropies step by step; forward-only phases timed; LB-Micro padded to equal
    counts; and the first update's loss exactly -sum(advantage x response tokens) / the
    minibatch's response tokens: it runs on the policy that computed the old log-probabilities
    (ratio 1), whose reference is that same initial policy (KL 0)."""
    from odc.train import grpo

    collective = runs[0]
    for run in runs:
        assert len(run["losses"]) == 4  # 2 RL steps (1 warm-up) x K = 2 update minibatches
        (first, second) = run["rl"]["phase_seconds"]
        # The planner's span of each RL step's forward-only minibatch, with the forward cost.
        assert len(run["rl"]["predicted_phase_seconds"]) == 2
        assert all(p > 0 for p in run["rl"]["predicted_phase_seconds"])
        assert first["old_logprobs"] > 0 and first["ref_logprobs"] > 0
        # A random tiny model: entropy near ln(vocab) = ln(1024) = 6.93 nats per token.
        assert all(6.0 < e < 7.0 for e in run["rl"]["entropy"])
    for run in runs[1:]:
        assert run["losses"] == pytest.approx(collective["losses"], rel=1e-4, abs=1e-6)
        assert run["grad_norms"] == pytest.approx(collective["grad_norms"], rel=1e-4)
        assert run["rl"]["entropy"] == pytest.approx(collective["rl"]["entropy"], rel=1e-5)
    assert all(len({len(r) for r in mb}) == 1 for mb in collective["microbatch_log"])
    rollouts = grpo.read_rollouts(str(path))
    step = rollouts[:16]  # 4 prompts of 4 responses
    advantages = grpo.group_advantages(grpo.synthetic_rewards(step), [r.group for r in step])
    first = range(8)  # the first update minibatch: 2 of the step's 4 groups
    tokens = sum(step[i].response_tokens for i in first)
    expected = -sum(advantages[i] * step[i].response_tokens for i in first) / tokens
    for run in runs:
        assert run["losses"][0] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_forward_cost_scales_every_term_by_the_forward_share():
    from odc.train.grpo_run import FORWARD_FRACTION, _forward_costs

    assert _forward_costs((4.0, 8.0, 12.0, 16.0), True) == (1.0, 2.0, 3.0, 4.0)
    assert FORWARD_FRACTION[False] == pytest.approx(1 / 3)
