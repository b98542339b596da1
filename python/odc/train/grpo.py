"""The arithmetic of GRPO's training phase, kept apart from the run that schedules it:
rollouts shaped like math RL (data/grpo_math_like.tsv), group-normalized advantages, token
log-probabilities and entropy, the PPO clipped objective with asymmetric clipping, and the KL to a
reference policy. Every loss here is a SUM over response tokens: the caller divides by the
minibatch's response tokens over all ranks (odc.torch.scale_loss(loss_sum, global_tokens)), which
is the "token-mean over the whole minibatch" normalization, the same whatever the microbatch
counts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import numpy as np

from ..errors import InvalidArgument
from .data import IGNORE_INDEX
from .._numbers import whole_number

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # PPO ratio clipped to [1 - 0.2, 1 + 0.28] ("clip-higher")


@dataclass(frozen=True)
class Rollout:
    """One response of a GRPO group: its prompt's and its own token counts."""

    group: int
    prompt_tokens: int
    response_tokens: int

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.response_tokens


def read_rollouts(path: str) -> List[Rollout]:
    """Rows `group prompt_tokens response_tokens` ('#' lines are comments), every group's rows
    consecutive and sharing one prompt length, as data/generate_lengths.py writes them. Numbers
    are plain digits 0-9 (odc._numbers.whole_number: no '+', '_' or other scripts' digits)."""
    rollouts, seen = [], set()
    try:
        lines = Path(path).read_text().splitlines()
    except UnicodeDecodeError as error:
        raise InvalidArgument(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            group, prompt, response = (whole_number(v) for v in text.split())
        except ValueError:
            raise InvalidArgument(
                f"{path}:{number}: expected 'group prompt_tokens response_tokens' (whole numbers, "
                f"digits 0-9), got {line!r}"
            ) from None
        if prompt < 1 or response < 1:
            raise InvalidArgument(f"{path}:{number}: token counts must be >= 1, got {line!r}")
        previous = rollouts[-1] if rollouts else None
        if previous is not None and previous.group == group and previous.prompt_tokens != prompt:
            raise InvalidArgument(
                f"{path}:{number}: group {group} has prompts of {previous.prompt_tokens} and "
                f"{prompt} tokens (a group shares one prompt)"
            )
        if (previous is None or group != previous.group) and group in seen:
            raise InvalidArgument(f"{path}:{number}: group {group}'s rows are not consecutive")
        seen.add(group)
        rollouts.append(Rollout(group, prompt, response))
    if not rollouts:
        raise InvalidArgument(f"{path}: no rollouts")
    return rollouts


def group_advantages(rewards: Sequence[float], groups: Sequence[int], eps: float = 1e-6):
    """GRPO's advantage of each response: its reward minus its group's mean, over the group's
    standard deviation (+ eps); 0 for every response of a group whose rewards are all equal."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape:
        raise InvalidArgument(f"{rewards.shape[0]} rewards for {groups.shape[0]} group ids")
    advantages = np.zeros_like(rewards)
    for group in np.unique(groups):
        members = groups == group
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std() + eps)
    return advantages


def token_logprobs(logits, labels, ignore_index: int = IGNORE_INDEX):
    """(log-probability of each label, the entropy of each position's distribution), fp32, 0
    where the label is `ignore_index`; logits [T, vocab], labels [T]."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(picked)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


def ppo_clip_loss_sum(logprobs, old_logprobs, advantages, mask, low=CLIP_LOW, high=CLIP_HIGH):
    """Sum over masked (response) tokens of the PPO clipped objective's loss,
    -min(r * A, clip(r, 1 - low, 1 + high) * A) with r = exp(logprobs - old_logprobs); per-token
    `advantages` (a response's advantage on each of its tokens)."""
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    return -(torch.minimum(unclipped, clipped) * mask).sum()


def kl_sum(logprobs, ref_logprobs, mask):
    """Sum over masked tokens of the KL estimate to the reference policy ("k3": exp(d) - d - 1,
    d = ref - policy log-probability; >= 0, unbiased, low variance)."""
    import torch

    delta = ref_logprobs - logprobs
    return ((torch.exp(delta) - delta - 1.0) * mask).sum()


def response_labels(tokens, prompt_tokens: int, ignore_index: int = IGNORE_INDEX):
    """Next-token labels of one rollout (prompt then response, `tokens` [L] int64) that carry a
    loss only on the response: position t predicts token t + 1, kept where t + 1 is a response
    token (t >= prompt_tokens - 1); every other position, and the last, is `ignore_index`."""
    import torch

    if not 1 <= prompt_tokens < len(tokens):
        raise InvalidArgument(
            f"a rollout of {len(tokens)} tokens cannot have a prompt of {prompt_tokens} (the "
            "response needs at least one token)"
        )
    labels = torch.full_like(tokens, ignore_index)
    labels[prompt_tokens - 1 : -1] = tokens[prompt_tokens:]
    return labels


def synthetic_rewards(rollouts: Sequence[Rollout], seed: int = 0) -> np.ndarray:
    """A 0/1 reward per response, for runs without a verifier: each group draws a success rate
    (uniform), each response succeeds with it, so some groups are all 0 or all 1 (no advantage,
    as in real GRPO batches) and others are mixed. Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    rates = {g: rng.uniform() for g in sorted({r.group for r in rollouts})}
    return np.array([float(rng.uniform() < rates[r.group]) for r in rollouts])


def rl_steps(rollouts: Sequence[Rollout], prompts_per_step: int, minibatches_per_step: int):
    """The RL steps over `rollouts`: each a list of `minibatches_per_step` minibatches (lists of
    rollout indices), `prompts_per_step` whole groups per step split evenly over its minibatches
    in order (a group is never split across minibatches). A trailing partial step is dropped."""
    if prompts_per_step < 1 or minibatches_per_step < 1:
        raise InvalidArgument("prompts_per_step and minibatches_per_step must be >= 1")
    if prompts_per_step % minibatches_per_step:
        raise InvalidArgument(
            f"{prompts_per_step} prompts per step do not split evenly into "
            f"{minibatches_per_step} minibatches"
        )
    groups: List[List[int]] = []
    for index, rollout in enumerate(rollouts):
        if not groups or rollouts[groups[-1][0]].group != rollout.group:
            groups.append([])
        groups[-1].append(index)
    per_minibatch = prompts_per_step // minibatches_per_step
    steps = []
    for start in range(0, len(groups) - prompts_per_step + 1, prompts_per_step):
        step_groups = groups[start : start + prompts_per_step]
        steps.append(
            [
                [i for g in step_groups[m : m + per_minibatch] for i in g]
                for m in range(0, prompts_per_step, per_minibatch)
            ]
        )
    return steps


def ppo_objective(old_logprobs, token_advantages, ref_logprobs=None, kl_coef: float = 0.0):
    """The actor's loss for PackedCausalLM.forward(objective=...): per chunk of logits, the
    clipped PPO loss plus kl_coef x the KL to the reference, summed over the response tokens
    (those whose label is not ignored). old_logprobs, token_advantages, ref_logprobs: fp32 [T]
    of the whole microbatch (the chunk picks its rows by `begin`)."""
    import torch

    if kl_coef and ref_logprobs is None:
        raise InvalidArgument("a KL coefficient needs the reference log-probabilities")

    def objective(logits, labels, begin):
        end = begin + logits.shape[0]
        mask = (labels != IGNORE_INDEX).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        logp = logp * mask
        loss = ppo_clip_loss_sum(logp, old_logprobs[begin:end], token_advantages[begin:end], mask)
        if kl_coef:
            loss = loss + kl_coef * kl_sum(logp, ref_logprobs[begin:end], mask)
        return loss

    return objective
