"""What a short microbatch's host time is made of, on one GPU (issue #42): odc.train's 1.5b model,
forward + backward with activation checkpointing, in variants that change one thing at a time:
the attention call (aten's flash op directly, as odc.train does, or torch.nn.attention's
varlen_attn, which runs the same kernels through Python custom ops), eager or compiled blocks,
plain bf16 parameters or FSDP2 on one rank (its hooks, casts and copies, no peer), with or
without liger-kernel's fused RMSNorm / SwiGLU / RoPE and fused linear cross-entropy (when
liger_kernel is importable). Per variant: host time (until backward() returns), wall time, the
GPU's busy time (union of its kernels' intervals, torch's profiler) and the kernel launches, per
microbatch; the first microbatch's loss, equal across the variants to bf16's precision. First,
aten's op against varlen_attn on random inputs (outputs and gradients).

  python dev/gpu/host_variants.py [--tokens 512] [--repeats 10] [--only SUBSTRING ...]

One process: every variant compiles its own blocks (torch's recompile limit is raised so that
later variants do not fall back to eager). Times on a shared host vary by 20-30% between runs;
compare variants within one run.
"""

import argparse
import gc
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

# this folder's: the union of kernel intervals, a block's forward inside torch's checkpoint
from host_floor import _checkpointed_block_forward, _union_seconds
from odc import _packed_attention as packed_attention_module
from odc.train import model as train_model

DEVICE = torch.device("cuda", 0)


# odc.train's attention call, kept before build() swaps the module's for a variant.
ORIGINAL_FLASH = packed_attention_module._flash_varlen_causal


def varlen_attention(q, k, v, boundaries, longest, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(
        q, k, v, boundaries, boundaries, longest, longest, scale=scale, window_size=(-1, 0)
    )


def compare_attention_ops():
    torch.manual_seed(1)
    shapes = [(700, 12, 128), (700, 2, 128), (700, 2, 128)]
    inputs = [torch.randn(s, device=DEVICE, dtype=torch.bfloat16) for s in shapes]
    boundaries = torch.tensor([0, 300, 650, 700], dtype=torch.int32, device=DEVICE)
    results = []
    for attend in (ORIGINAL_FLASH, varlen_attention):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend(*leaves, boundaries, 350, 0.1)
        out.float().pow(2).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), *results):
        diff = float((ours.float() - theirs.float()).abs().max())
        print(f"aten op vs varlen_attn, {name}: max abs difference {diff:.3e}")


def compile_blocks_with(model, inductor):
    """compile_blocks with one of inductor's launch-overhead options: "cpp_wrapper" (the
    generated code launches its kernels from C++ rather than Python) or "cudagraphs" (each block's
    forward and backward replayed as CUDA graphs, one per token count: torch's reduce-overhead),
    or "checkpoint inside" (+ " cudagraphs"): the checkpoint inside the compiled function instead
    of around it."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, train_model.RECOMPILE_LIMIT)
    for layer in model.layers:
        if inductor.startswith("checkpoint inside"):
            # The recomputation inside the compiled function: AOTAutograd's backward graph
            # recomputes, so no forward runs during backward (which CUDA graph trees refuse).
            # Dynamic token dimension as compile_blocks (the "compiled" rows), static for CUDA
            # graphs as the "cudagraphs" rows: one change against each.
            layer.gradient_checkpointing = False
            graphs = inductor.endswith("cudagraphs")
            layer.forward = torch.compile(
                types.MethodType(_checkpointed_block_forward, layer),
                dynamic=not graphs,
                mode="reduce-overhead" if graphs else None,
            )
        elif inductor == "cpp_wrapper":
            layer.forward = torch.compile(
                layer.forward, dynamic=True, options={"cpp_wrapper": True}
            )
        else:
            layer.forward = torch.compile(layer.forward, dynamic=False, mode="reduce-overhead")


def build(attention, compiled, fsdp, liger, inductor=None):
    packed_attention_module._flash_varlen_causal = (
        ORIGINAL_FLASH if attention == "aten" else varlen_attention
    )
    with DEVICE:
        model = train_model.build_model("1.5b")
    model.gradient_checkpointing_enable()
    if fsdp:  # compiled after fully_shard, as odc.train does (train_model.shard_blocks)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sharded_compiled = compiled and inductor is None
        assert train_model.shard_blocks(model, compile=sharded_compiled, mp_policy=policy) == (
            sharded_compiled
        )
    else:
        model.to(torch.bfloat16)
        if compiled and inductor is None:
            assert train_model.compile_blocks(model)
    if compiled and inductor is not None:
        compile_blocks_with(model, inductor)
    if liger == "flce":
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def forward(input_ids, position_ids, labels, boundaries, longest):
            hidden = model.hidden_states(input_ids, position_ids, boundaries, longest)
            return loss(model.lm.lm_head.weight, hidden, labels)

        model.forward = forward
    return model


def measure(model, tokens, repeats):
    vocab = model.config.vocab_size
    positions = torch.arange(tokens, device=DEVICE)
    boundaries = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
    generator = torch.Generator().manual_seed(0)
    losses = []

    def microbatch():
        ids = torch.randint(0, vocab, (tokens,), generator=generator).to(DEVICE)
        loss = model(ids, positions, torch.roll(ids, -1), boundaries, tokens)
        (loss / tokens).backward()
        losses.append(loss.detach())

    for _ in range(3):
        microbatch()
    hosts, walls = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        microbatch()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        hosts.append(returned - started)
        walls.append(time.perf_counter() - started)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        microbatch()
        microbatch()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    ]
    launches = sum(
        e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx") for e in events
    )
    return hosts, walls, _union_seconds(kernels) * 1e3 / 2, launches / 2, float(losses[0]) / tokens


VARIANTS = [  # name: attention, compiled, fsdp, liger[, inductor option]
    ("eager, varlen_attn", "varlen", False, False, None),
    ("eager, aten op", "aten", False, False, None),
    ("compiled, varlen_attn", "varlen", True, False, None),
    ("compiled, aten op", "aten", True, False, None),
    ("compiled cpp_wrapper, aten op", "aten", True, False, None, "cpp_wrapper"),
    ("compiled cudagraphs, aten op", "aten", True, False, None, "cudagraphs"),
    ("compiled, checkpoint inside, aten op", "aten", True, False, None, "checkpoint inside"),
    (
        "compiled cudagraphs, checkpoint inside, aten op",
        "aten",
        True,
        False,
        None,
        "checkpoint inside cudagraphs",
    ),  # fmt: skip
    ("fsdp2 eager, varlen_attn", "varlen", False, True, None),
    ("fsdp2 eager, aten op", "aten", False, True, None),
    ("fsdp2 compiled, varlen_attn", "varlen", True, True, None),
    ("fsdp2 compiled, aten op", "aten", True, True, None),
    ("liger eager, aten op", "aten", False, False, "kernels"),
    ("liger eager + flce, aten op", "aten", False, False, "flce"),
    ("liger fsdp2 compiled + flce, aten op", "aten", True, True, "flce"),
    ("fsdp2 compiled cpp_wrapper, aten op", "aten", True, True, None, "cpp_wrapper"),
    ("fsdp2 compiled cudagraphs, aten op", "aten", True, True, None, "cudagraphs"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=[], help="variants whose name contains one")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_variants.py needs a GPU", file=sys.stderr)
        return 1
    torch.cuda.set_device(DEVICE)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29557")
    dist.init_process_group("nccl", rank=0, world_size=1)  # FSDP2 on one rank
    try:
        import liger_kernel  # noqa: F401

        has_liger = True
    except ImportError:
        has_liger = False
    compare_attention_ops()
    print(f"1.5b, {args.tokens} tokens, {torch.cuda.get_device_name(0)}; ms per microbatch, "
          f"median of {args.repeats} (min)")  # fmt: skip
    liger_applied = False
    for name, attention, compiled, fsdp, liger, *inductor in VARIANTS:
        if args.only and not any(o in name for o in args.only):
            continue
        if liger and not has_liger:
            print(f"{name:38s} skipped: liger_kernel is not importable")
            continue
        if liger and not liger_applied:  # patches transformers' Qwen2 classes: the later variants
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            apply_liger_kernel_to_qwen2(fused_linear_cross_entropy=False)
            liger_applied = True
        try:
            model = build(attention, compiled, fsdp, liger, *inductor)
            hosts, walls, gpu, launches, loss = measure(model, args.tokens, args.repeats)
        except Exception as error:  # a variant that cannot run says why; the others go on
            print(f"{name:38s} failed: {type(error).__name__}: {str(error)[:200]}")
            continue
        finally:
            model = None
            torch._dynamo.reset()  # a variant's compile options must not reach the next one
            gc.collect()  # compiled blocks hold their module in a cycle
            torch.cuda.empty_cache()
        print(
            f"{name:38s} host {statistics.median(hosts) * 1e3:6.1f} ({min(hosts) * 1e3:6.1f})"
            f"  wall {statistics.median(walls) * 1e3:6.1f}  gpu busy {gpu:6.1f}"
            f"  launches {launches:5.0f}  loss {loss:.4f}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
