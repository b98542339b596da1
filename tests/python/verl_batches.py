"""What odc.verl's CPU tests (test_verl_backend.py) and its GPU check (dev/gpu/verl_engine_gpu.py)
both hand verl's engine: verl pointed at the CPU, and a PPO rollout batch as verl's trainer builds
it. Imports verl only inside the functions, so that importing this module needs no verl."""

from __future__ import annotations


def point_verl_at_cpu():
    """verl 0.9.1 asks its platform for the device (CUDA without a GPU); point it at the CPU.
    Each name patched is a module-level import verl's engine calls with no device argument."""
    from verl.utils import fsdp_utils, seqlen_balancing
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp import utils as fsdp_engine_utils

    fsdp_engine_utils.get_device_name = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None  # reads CUDA memory
    transformer_impl.get_device_id = lambda: "cpu"
    transformer_impl.get_device_name = lambda: "cpu"
    seqlen_balancing.get_device_name = lambda: "cpu"
    fsdp_utils.get_device_id = lambda: "cpu"


def ppo_minibatch(
    samples_by_rank, rank, vocab, max_tokens, remove_padding=False, advantage_per_rollout=False
):
    """A rollout batch as verl's trainer hands it to the actor: the whole batch padded to one
    width (left-padded prompts, right-padded responses), then split among the ranks; this rank's
    rows turned into nested ones by verl's own left_right_2_no_padding.
    samples_by_rank[r]: rank r's (prompt tokens, response tokens) pairs. Random tokens, old
    log-probs and advantages from a generator seeded by the rank; advantages per response token,
    or one per rollout (GRPO) with `advantage_per_rollout`."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    samples = samples_by_rank[rank]
    num = len(samples)
    prompt_width = max(p for s in samples_by_rank for p, _ in s)
    response_width = max(r for s in samples_by_rank for _, r in s)
    generator = torch.Generator().manual_seed(200 + rank)
    prompts = torch.zeros(num, prompt_width, dtype=torch.long)
    responses = torch.zeros(num, response_width, dtype=torch.long)
    attention_mask = torch.zeros(num, prompt_width + response_width, dtype=torch.long)
    response_mask = torch.zeros(num, response_width, dtype=torch.long)
    for i, (p, r) in enumerate(samples):
        prompts[i, prompt_width - p :] = torch.randint(0, vocab, (p,), generator=generator)
        responses[i, :r] = torch.randint(0, vocab, (r,), generator=generator)
        attention_mask[i, prompt_width - p : prompt_width + r] = 1
        response_mask[i, :r] = 1
    # Old log-probs away from the current ones, so that PPO's clip acts.
    old_log_probs = -4.0 + 0.5 * torch.randn(num, response_width, generator=generator)
    if advantage_per_rollout:
        advantages = torch.randn(num, 1, generator=generator).expand(num, response_width).clone()
    else:
        advantages = torch.randn(num, response_width, generator=generator)
    data = tu.get_tensordict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages,
        },
        non_tensor_dict=dict(
            use_dynamic_bsz=True,
            max_token_len_per_gpu=max_tokens,
            use_remove_padding=remove_padding,
            temperature=1.0,
            global_batch_size=sum(len(s) for s in samples_by_rank),
        ),
    )
    return left_right_2_no_padding(data)
