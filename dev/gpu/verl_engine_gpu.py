"""odc's verl engine on GPUs, one process per GPU as Ray places verl's workers (issue #44 item 6):
(a) OdcEngineWithLMHead against verl's stock FSDP2 engine (FSDPEngineWithLMHead) on one PPO
minibatch of a tiny random Qwen2: first-step loss within 1e-2, grad norm within rtol 3e-2;
(b) each rank sees only its own GPU (CUDA_VISIBLE_DEVICES per process, NCCL over env://), so odc's
CUDA transport maps its peer's memory across processes that each see one device;
(c) the update phase of a GRPO-shaped minibatch (lengths from data/grpo_math_like.tsv, verl's
ppo_loss, dynamic batch size) under odc and under stock FSDP2 with and without verl's sync
deferral (use_no_sync_for_gradient_accumulation): a table of times, peak memory, microbatches.

    python3 dev/gpu/verl_engine_gpu.py          # 2 GPUs (NCCL, bf16 mixed precision)
    python3 dev/gpu/verl_engine_gpu.py --cpu    # the same code paths on gloo, fp32, tiny sizes
    python3 dev/gpu/verl_engine_gpu.py --all-visible  # both GPUs visible to both ranks

verl must be importable (dev/gpu/run.sh's stage verl-gpu puts a carried copy on PYTHONPATH).
The parent process only launches the ranks; each rank is this file with --rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
# The batch builder and the CPU patches shared with tests/python/test_verl_backend.py.
sys.path.insert(0, str(ROOT / "tests" / "python"))
from verl_batches import point_verl_at_cpu, ppo_minibatch  # noqa: E402

WORLD_SIZE = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="gloo, fp32, tiny sizes, no CUDA")
    p.add_argument(
        "--all-visible",
        action="store_true",
        help="every rank sees both GPUs and uses GPU <rank> (torchrun's layout): the fallback "
        "when odc's CUDA transport fails with one device per process",
    )
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a launched rank
    p.add_argument("--rollouts", type=int, default=None, help="(c) rollouts per rank (16; cpu 4)")
    p.add_argument("--hidden", type=int, default=None, help="(c) hidden size (1024; cpu 64)")
    p.add_argument("--layers", type=int, default=None, help="(c) layers (8; cpu 2)")
    p.add_argument("--repeats", type=int, default=3, help="(c) timed minibatches after 1 warm-up")
    p.add_argument("--timeout", type=float, default=230.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    # (c)'s sizes; lengths are the TSV's divided by `scale` (cpu: 200, so ~50 tokens a rollout).
    gpu = dict(rollouts=16, hidden=1024, layers=8, vocab=32768, scale=1, max_tokens=24576)
    cpu = dict(rollouts=4, hidden=64, layers=2, vocab=256, scale=200, max_tokens=160)
    for key, value in (cpu if args.cpu else gpu).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ----- the parent: two ranks, each with its own CUDA_VISIBLE_DEVICES (as Ray sets it) -----


def launch(args) -> int:
    with socket.socket() as s:  # a free port for env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_device = not args.cpu and not args.all_visible
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(WORLD_SIZE))))
    procs = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["LOCAL_RANK"] = "0" if one_device else str(rank)
        if one_device:
            # One device per process, as Ray places verl's workers: torch, NCCL and odc each
            # see "cuda:0" only, and odc's CUDA transport maps memory of a GPU it cannot see.
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank]
        command = [sys.executable, __file__, "--rank", str(rank)] + sys.argv[1:]
        procs.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + args.timeout
    codes = [None] * WORLD_SIZE
    while any(c is None for c in codes):
        codes = [p.poll() for p in procs]
        failed = any(c not in (None, 0) for c in codes)
        if failed or time.monotonic() > deadline:
            # One rank down (or out of time) would leave the other waiting in a collective.
            print(f"verl_engine_gpu: ranks' exit codes {codes}; stopping the others", flush=True)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return 1
        time.sleep(0.2)
    return 0


# ----- one rank -----


def packed_path(cpu: bool) -> bool:
    """verl's packed forward (use_remove_padding=True) attends through flash-attn's varlen
    kernels; without flash-attn (or on the CPU) verl's padded path runs instead."""
    if cpu:
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def read_rollouts():
    """(prompt_tokens, response_tokens) of every rollout in data/grpo_math_like.tsv."""
    rows = []
    for line in (ROOT / "data" / "grpo_math_like.tsv").read_text().splitlines():
        fields = line.split()
        if fields and fields[0].isdigit():
            rows.append((int(fields[1]), int(fields[2])))
    return rows


def draw(rollouts, per_rank, scale, seed):
    """Each rank's (prompt, response) lengths: a seeded draw of the TSV's GRPO groups (8 responses
    of one prompt), divided by `scale`, at least 1 token each; the same on every rank."""
    import random

    generator = random.Random(seed)
    groups = [rollouts[i : i + 8] for i in range(0, len(rollouts) - 7, 8)]
    chosen = []
    while len(chosen) < per_rank * WORLD_SIZE:
        chosen.extend(generator.choice(groups))
    chosen = [(max(1, p // scale), max(1, r // scale)) for p, r in chosen[: per_rank * WORLD_SIZE]]
    return [chosen[r * per_rank : (r + 1) * per_rank] for r in range(WORLD_SIZE)]


def make_engine(stock: bool, model_fn, cpu: bool, remove_padding: bool, defer_sync=True):
    """verl's engine class (stock FSDP2 or odc's), initialized by verl's _build_model_optimizer
    (FSDP2 wrapping, verl's AdamW) with `model_fn`'s model instead of an HF checkpoint, and no LR
    scheduler. GPU: verl's default mixed precision (bf16 compute, fp32 reduce and master
    weights); CPU: fp32."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from odc.verl.engine import OdcEngineWithLMHead

    base = FSDPEngineWithLMHead if stock else OdcEngineWithLMHead

    class Engine(base):
        def _build_module(self):
            return model_fn()

        def _build_lr_scheduler(self, optimizer):
            return None

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        mixed_precision=fp32 if cpu else None,  # None: verl's bf16 / fp32 default
        use_torch_compile=False,
        use_no_sync_for_gradient_accumulation=defer_sync,
    )
    if not stock:  # as FSDPActorConfig passes actor.strategy=odc to its engine config
        object.__setattr__(engine_config, "strategy", "odc")
    optimizer_config = FSDPOptimizerConfig(optimizer="AdamW", lr=1e-5, weight_decay=0.01)
    model_config = SimpleNamespace(
        use_remove_padding=remove_padding,
        lora_rank=0,
        enable_activation_offload=False,
        enable_gradient_checkpointing=False,
    )
    engine = Engine(model_config, engine_config, optimizer_config, checkpoint_config=None)
    engine._build_model_optimizer()
    return engine


def qwen2(hidden, layers, vocab, remove_padding, cpu):
    """A Qwen2 with random weights, the same on every rank (seeded), built on the CPU in fp32
    (verl's model_dtype for training); verl's FSDP2 build moves the shards to the device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(4, hidden // 128)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    config._attn_implementation = (
        "eager" if cpu else ("flash_attention_2" if remove_padding else "sdpa")
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    if remove_padding:  # what verl's _build_module applies for its packed path
        from verl.models.transformers.monkey_patch import apply_monkey_patch

        apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
    return model


def ppo_loss_fn(max_tokens, mini_batch_size):
    import functools

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(
        strategy="fsdp2",
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=max_tokens,
        ppo_mini_batch_size=mini_batch_size,
        rollout_n=1,
    )
    return functools.partial(ppo_loss, config)


def step_summary(outputs):
    """(loss as verl's worker reports it: per-rank sum, mean over ranks; grad norm; this rank's
    microbatches)."""
    import torch
    import torch.distributed as dist

    loss = torch.tensor(sum(outputs["loss"]), dtype=torch.float64)
    if torch.cuda.is_available():
        loss = loss.cuda()
    dist.all_reduce(loss)
    grad_norm = float(outputs["metrics"]["grad_norm"])
    return float(loss) / dist.get_world_size(), grad_norm, len(outputs["loss"])


def gathered(value):
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def transport_of(engine) -> str:
    comm = engine.odc_engine.comm
    if comm.over_nvshmem:
        return "nvshmem"
    import torch

    from odc.comm import default_transport

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return default_transport(device)


def check_against_stock(args, rank, remove_padding, say):
    """(a) and (b): one PPO minibatch, odc's engine (LB-Mini on, then off) against verl's stock
    engine from the same initial weights."""
    import torch

    hidden, layers, vocab = (32, 2, 64) if args.cpu else (256, 4, 1024)
    max_tokens, scale = (56, 400) if args.cpu else (2048, 20)  # >= the longest rollout
    samples = draw(read_rollouts(), 6, scale, seed=1)
    model_fn = lambda: qwen2(hidden, layers, vocab, remove_padding, args.cpu)  # noqa: E731
    loss_fn = ppo_loss_fn(max_tokens, sum(len(s) for s in samples))
    say(
        f"(a) tiny Qwen2 {hidden}x{layers} vocab {vocab}, {'fp32' if args.cpu else 'bf16'}, "
        f"6 rollouts per rank (tokens per rank {gathered(sum(p + r for p, r in samples[rank]))}), "
        f"max_token_len_per_gpu {max_tokens}; first step against fsdp2"
    )
    ok = True
    stock = None
    for name, lb_mini in (("fsdp2", None), ("odc (LB-Mini)", "1"), ("odc (no LB-Mini)", "0")):
        if lb_mini is not None:
            os.environ["ODC_VERL_LB_MINI"] = lb_mini  # read when odc's engine is built
        try:
            engine = make_engine(lb_mini is None, model_fn, args.cpu, remove_padding)
        except Exception as error:  # odc's communicator is made here: say so before the traceback
            say(f"(b) FAILED building {name} (odc's communicator is made here): {error!r}")
            raise
        if lb_mini == "1":
            devices = gathered(
                (os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
                if torch.cuda.is_available()
                else (None, 0)
            )
            say(
                f"(b) odc transport: {transport_of(engine)}; per rank (CUDA_VISIBLE_DEVICES, "
                f"devices seen): {devices}"
            )
        outputs = engine.train_batch(
            ppo_minibatch(
                samples, rank, vocab, max_tokens, remove_padding, advantage_per_rollout=True
            ),
            loss_function=loss_fn,
        )
        loss, norm, count = step_summary(outputs)
        counts = gathered(count)
        if lb_mini is None:
            stock = (loss, norm)
            say(f"    {name:<17} loss {loss:.6f} grad norm {norm:.6f} microbatches {counts}")
        else:
            engine.odc_engine.comm.close()
            loss_diff = abs(loss - stock[0])
            norm_rel = abs(norm - stock[1]) / max(abs(stock[1]), 1e-12)
            good = loss_diff <= 1e-2 and norm_rel <= 3e-2
            ok = ok and good
            say(
                f"    {name:<17} loss {loss:.6f} grad norm {norm:.6f} microbatches {counts}: "
                f"|loss diff| {loss_diff:.2e} (<= 1e-2), grad norm rel {norm_rel:.2e} (<= 3e-2): "
                + ("ok" if good else "FAIL")
            )
        del engine, outputs
    return ok


def time_update(args, rank, remove_padding, say):
    """(c): the update phase (verl's train_batch: forward, backward, clipping, the step) of one
    GRPO-shaped minibatch per arm, a warm-up then `repeats` timed runs of the same minibatch."""
    import torch
    import torch.distributed as dist

    samples = draw(read_rollouts(), args.rollouts, args.scale, seed=2)
    loss_fn = ppo_loss_fn(args.max_tokens, args.rollouts * WORLD_SIZE)
    model_fn = lambda: qwen2(  # noqa: E731
        args.hidden, args.layers, args.vocab, remove_padding, args.cpu
    )
    tokens = gathered(sum(p + r for p, r in samples[rank]))
    say(
        f"(c) Qwen2 {args.hidden}x{args.layers} vocab {args.vocab}, "
        f"{'fp32' if args.cpu else 'bf16'}, {args.rollouts} rollouts per rank (tokens per rank "
        f"{tokens}), max_token_len_per_gpu {args.max_tokens}, {args.repeats} repeats after 1 warm-up"
    )
    arms = (
        ("odc (LB-Mini)", False, True, "1"),
        ("odc (no LB-Mini)", False, True, "0"),
        ("fsdp2, deferred sync", True, True, None),
        ("fsdp2, sync each microbatch", True, False, None),
    )
    rows = []
    for name, stock, defer_sync, lb_mini in arms:
        if lb_mini is not None:  # read when odc's engine is built
            os.environ["ODC_VERL_LB_MINI"] = lb_mini
        engine = make_engine(stock, model_fn, args.cpu, remove_padding, defer_sync)
        data = ppo_minibatch(
            samples, rank, args.vocab, args.max_tokens, remove_padding, advantage_per_rollout=True
        )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, counts = [], []
        for repeat in range(args.repeats + 1):
            dist.barrier()
            begin = time.perf_counter()
            outputs = engine.train_batch(data.clone(), loss_function=loss_fn)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - begin
            if repeat > 0:  # the first is the warm-up
                times.append(max(gathered(elapsed)))  # the minibatch ends with its slowest rank
                counts = gathered(len(outputs["loss"]))
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        odc_bytes = 0
        if not stock:
            odc_bytes = sum(engine.odc_engine.memory_bytes().values())
            engine.odc_engine.comm.close()
        peaks = gathered((peak, odc_bytes / 2**30))
        rows.append((name, times, peaks, counts))
        del engine, outputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    say(f"{'arm':<28} {'median s (min-max)':<22} {'peak GiB':<14} {'odc GiB':<12} microbatches")
    for name, times, peaks, counts in rows:
        spread = f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"
        torch_peak = "/".join(f"{p:.1f}" for p, _ in peaks)
        odc_peak = "/".join(f"{o:.2f}" for _, o in peaks) if "odc" in name else "-"
        say(f"{name:<28} {spread:<22} {torch_peak:<14} {odc_peak:<12} {counts}")
    say(
        "peak GiB: torch.cuda.max_memory_allocated per rank (0 on the CPU); odc GiB: odc's own "
        "buffers per rank (OdcFSDP.memory_bytes(), outside torch's allocator)"
    )


def rank_main(args) -> int:
    rank = args.rank
    if args.cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    if not args.cpu:  # the only device this process sees, or its own of all (--all-visible)
        torch.cuda.set_device(rank if args.all_visible else 0)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method="env://")
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    try:
        import verl

        if args.cpu:
            point_verl_at_cpu()
        remove_padding = packed_path(args.cpu)
        say(
            f"verl {verl.__version__} from {Path(verl.__file__).parent}; torch "
            f"{torch.__version__}; transformers {__import__('transformers').__version__}; "
            f"{'gloo, CPU' if args.cpu else 'nccl, ' + torch.cuda.get_device_name()}; forward: "
            + (
                "packed (use_remove_padding=True, flash-attn)"
                if remove_padding
                else "padded (use_remove_padding=False"
                + (": CPU)" if args.cpu else ": flash-attn not importable)")
            )
        )
        ok = check_against_stock(args, rank, remove_padding, say)
        time_update(args, rank, remove_padding, say)
        say("verl_engine_gpu: " + ("ok" if ok else "FAILED: (a) out of tolerance"))
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
