"""GRPO's training-phase arithmetic (odc.train.grpo): the rollouts file, group
advantages, token log-probabilities and entropy, the clipped PPO loss and the KL estimate,
against hand computations and torch's own functions."""

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="GRPO's losses are torch functions")

from odc.errors import InvalidArgument  # noqa: E402
from odc.train import grpo  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"


def test_read_rollouts_reads_the_shipped_file_and_names_bad_rows(tmp_path):
    rollouts = grpo.read_rollouts(str(DATA / "grpo_math_like.tsv"))
    assert len(rollouts) == 10_000 and rollouts[0].group == 0
    assert all(r.length == r.prompt_tokens + r.response_tokens for r in rollouts[:50])
    for text, fault in (
        ("0 10 5\n0 11 6\n", "shares one prompt"),
        ("0 10 5\n1 12 6\n0 10 7\n", "not consecutive"),
        ("0 10\n", "expected 'group prompt_tokens response_tokens'"),
        # int() takes these; a count in a data file is plain digits 0-9.
        ("0 1_0 5\n", "digits 0-9"),
        ("0 +10 5\n", "digits 0-9"),
        ("0 \u0661\u0660 5\n", "digits 0-9"),
        ("0 10 0\n", ">= 1"),
        ("# only a comment\n", "no rollouts"),
    ):
        path = tmp_path / "bad.tsv"
        path.write_text(text)
        with pytest.raises(InvalidArgument, match=fault):
            grpo.read_rollouts(str(path))


def test_group_advantages_normalize_within_each_group():
    rewards = [1.0, 0.0, 0.0, 1.0, 3.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1]
    advantages = grpo.group_advantages(rewards, groups)
    np.testing.assert_allclose(advantages[:4], [1, -1, -1, 1], atol=1e-5)  # mean .5, std .5
    assert advantages[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal
    with pytest.raises(InvalidArgument):
        grpo.group_advantages([1.0, 2.0], [0])


def test_token_logprobs_and_entropy_match_torch():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=generator)
    labels = torch.tensor([3, 0, -100, 6, 2])
    logp, entropy = grpo.token_logprobs(logits, labels)
    expected = torch.distributions.Categorical(logits=logits)
    valid = labels != -100
    torch.testing.assert_close(logp[valid], expected.log_prob(labels.clamp(min=0))[valid])
    torch.testing.assert_close(entropy[valid], expected.entropy()[valid])
    assert logp[2] == 0 and entropy[2] == 0


def test_ppo_clip_loss_clips_asymmetrically_and_counts_masked_tokens_only():
    old = torch.zeros(4)
    # ratios e^0.5 = 1.65 (above 1.28) and e^-0.5 = 0.61 (below 0.8), for A = +1 and -1
    new = torch.tensor([0.5, -0.5, 0.5, -0.5], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss = grpo.ppo_clip_loss_sum(new, old, advantages, mask)
    # token 0: min(1.65, 1.28) = 1.28; token 1: min(.61, .8) = .61; token 2: min(-1.65, -1.28)
    expected = -(1.28 + math.exp(-0.5) - math.exp(0.5))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # Clipped tokens carry no gradient; the unclipped ones do (d/dx of -e^x A = -e^x A).
    assert new.grad[0] == 0 and new.grad[3] == 0
    assert float(new.grad[1]) == pytest.approx(-math.exp(-0.5))
    assert float(new.grad[2]) == pytest.approx(math.exp(0.5))


def test_kl_sum_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    mask = torch.ones(3)
    assert float(grpo.kl_sum(logp, logp, mask)) == 0.0
    d = torch.tensor([0.3, -0.2, 0.0])
    value = float(grpo.kl_sum(logp, logp + d, mask))
    assert value == pytest.approx(sum(math.exp(x) - x - 1 for x in d.tolist()))
    assert value > 0


def test_response_labels_put_the_loss_on_response_tokens_only():
    tokens = torch.arange(10, 16)  # prompt 10, 11, 12; response 13, 14, 15
    labels = grpo.response_labels(tokens, 3)
    assert labels.tolist() == [-100, -100, 13, 14, 15, -100]
    with pytest.raises(InvalidArgument, match="at least one token"):
        grpo.response_labels(tokens, 6)


def test_synthetic_rewards_are_deterministic_and_give_mixed_and_uniform_groups():
    rollouts = grpo.read_rollouts(str(DATA / "grpo_math_like.tsv"))[:800]  # 100 groups of 8
    rewards = grpo.synthetic_rewards(rollouts, seed=3)
    assert set(rewards.tolist()) <= {0.0, 1.0}
    assert (rewards == grpo.synthetic_rewards(rollouts, seed=3)).all()
    by_group = rewards.reshape(100, 8).sum(1)
    assert ((by_group == 0) | (by_group == 8)).any() and ((by_group > 0) & (by_group < 8)).any()


def test_rl_steps_keep_groups_whole_and_in_order():
    rollouts = grpo.read_rollouts(str(DATA / "grpo_math_like.tsv"))[: 8 * 10]  # 10 groups of 8
    steps = grpo.rl_steps(rollouts, prompts_per_step=4, minibatches_per_step=2)
    assert len(steps) == 2  # 10 groups: two steps of 4, the last 2 groups dropped
    assert [len(mb) for step in steps for mb in step] == [16, 16, 16, 16]
    assert steps[0][0] == list(range(16)) and steps[1][1] == list(range(48, 64))
    with pytest.raises(InvalidArgument, match="evenly"):
        grpo.rl_steps(rollouts, prompts_per_step=3, minibatches_per_step=2)


def test_model_objective_equals_the_loss_on_whole_logits():
    """PackedCausalLM.forward(objective=ppo_objective(...)) sums the clipped loss over logits
    chunks; it equals the same loss on the whole microbatch's logits, value and gradients."""
    pytest.importorskip("transformers", reason="the packed model needs transformers")
    from odc.train import model as model_module
    from odc.train.data import pack

    model = model_module.build_model("tiny", seed=1)
    tokens = np.random.default_rng(2).integers(0, 1024, 37)
    packed = pack([tokens])
    t = torch.from_numpy
    inputs = (t(packed.input_ids), t(packed.position_ids))
    labels = grpo.response_labels(t(packed.input_ids), 9)
    rest = (t(packed.boundaries), packed.longest)
    old, _ = model.token_logprobs(*inputs, labels, *rest)
    generator = torch.Generator().manual_seed(4)
    old = old + 0.3 * torch.randn(old.shape, generator=generator)  # ratios clip and do not
    advantages = torch.randn(old.shape, generator=generator)
    ref = old - 0.1
    saved = model_module.LOSS_CHUNK_TOKENS
    model_module.LOSS_CHUNK_TOKENS = 8  # several chunks
    try:
        chunked = model(
            *inputs, labels, *rest, objective=grpo.ppo_objective(old, advantages, ref, 0.05)
        )
    finally:
        model_module.LOSS_CHUNK_TOKENS = saved
    chunked.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hidden = model.hidden_states(*inputs, *rest)
    logits = torch.nn.functional.linear(hidden, model.lm.lm_head.weight).float()
    mask = (labels != -100).float()
    logp, _ = grpo.token_logprobs(logits, labels)
    whole = grpo.ppo_clip_loss_sum(logp, old, advantages, mask) + 0.05 * grpo.kl_sum(
        logp, ref, mask
    )
    whole.backward()
    assert float(chunked.detach()) == pytest.approx(float(whole.detach()), rel=1e-5)
    for ours, theirs in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
