"""GRPO's training phase in odc.train (issue #30) on CPU processes: the forward-only phases, the
actor update over K minibatches, ODC + LB-Mini against collective + LB-Micro on the same rollouts
(the same arithmetic: the same losses step by step), the first update's PPO ratio of 1 (old
log-probabilities recomputed on the same policy) and a KL of 0 to the reference (the initial
policy)."""

import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.train needs torch")
pytest.importorskip("transformers", reason="the packed model needs transformers")

import odc  # noqa: E402


def _rollouts(path, groups=8, group_size=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(groups):
        prompt = int(rng.integers(4, 9))
        rows += [f"{group} {prompt} {int(rng.integers(8, 60))}" for _ in range(group_size)]
    path.write_text("# group prompt_tokens response_tokens\n" + "\n".join(rows) + "\n")
    return path


def _run(tmp_path, comm, policy, kl_coef=0.1):
    from odc.train import grpo
    from odc.train.grpo_run import RlConfig, run_grpo_rank
    from odc.train.run import RunConfig, default_store_path

    path = _rollouts(tmp_path / "rollouts.tsv")
    lengths = [r.length for r in grpo.read_rollouts(str(path))]
    with tempfile.TemporaryDirectory() as directory:
        config = RunConfig(
            preset="tiny", comm=comm, policy=policy, lengths=lengths, device="cpu", steps=1,
            samples_per_rank=4, max_tokens=256, store_path=default_store_path(directory),
            warmup_steps=1, activation_checkpointing=False, cost=(1.0, 0.01, 0.0),
        )  # fmt: skip
        rl = RlConfig(str(path), prompts_per_step=4, minibatches_per_step=2, kl_coef=kl_coef)
        return odc.launch(run_grpo_rank, 3, config, rl)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    return {arm: _run(tmp, *arm) for arm in (("odc", "lb-mini"), ("collective", "lb-micro"))}


def test_grpo_runs_under_odc_and_collectives_with_the_same_losses(runs):
    odc_run, collective = runs[("odc", "lb-mini")], runs[("collective", "lb-micro")]
    for run in (odc_run, collective):
        assert run["task"] == "grpo"
        assert len(run["losses"]) == 4  # 2 RL steps x K = 2 update minibatches
        (first, second) = run["rl"]["phase_seconds"]
        assert first["old_logprobs"] > 0 and first["ref_logprobs"] > 0
        # A random tiny model: entropy near ln(vocab) = ln(1024) = 6.93 nats per token.
        assert all(6.0 < e < 7.0 for e in run["rl"]["entropy"])
    assert odc_run["losses"] == pytest.approx(collective["losses"], rel=1e-4, abs=1e-6)
    assert odc_run["rl"]["entropy"] == pytest.approx(collective["rl"]["entropy"], rel=1e-5)
    assert all(len({len(r) for r in mb}) == 1 for mb in collective["microbatch_log"])  # padded


def test_first_update_has_ratio_one_and_no_kl(runs, tmp_path):
    """The first minibatch of an RL step runs on the policy that computed the old
    log-probabilities, the reference is that same initial policy: its loss is exactly
    -sum(advantage x response tokens) / the minibatch's response tokens."""
    from odc.train import grpo

    rollouts = grpo.read_rollouts(str(_rollouts(tmp_path / "rollouts.tsv")))
    step = rollouts[:16]  # 4 prompts of 4 responses
    advantages = grpo.group_advantages(grpo.synthetic_rewards(step), [r.group for r in step])
    first = range(8)  # the first update minibatch: 2 of the step's 4 groups
    tokens = sum(step[i].response_tokens for i in first)
    expected = -sum(advantages[i] * step[i].response_tokens for i in first) / tokens
    for run in runs.values():
        assert run["losses"][0] == pytest.approx(expected, rel=1e-4, abs=1e-6)
