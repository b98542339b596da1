"""Where a microbatch's time goes, FSDP2 against odc.torch (OdcFSDP), issue #42 items 1 and 3: per
arm and microbatch size, the wall time of one microbatch (forward + backward, the device
synchronized after), its host time (until backward() returns), and on a GPU how long its kernels
kept the device busy (torch's profiler, the union of their intervals: "compute", and "moving" for
NCCL's and odc's transfers, copies and fills, which may spin waiting for a peer); with --profile, the host functions that
took the most time in each arm (cProfile, rank 0), which is where odc's extra host time per
microbatch shows. Both arms run odc.train's model (build_model's Qwen2 with its packed attention),
bf16 parameters with fp32 reduction and activation checkpointing, as odc.train runs them; FSDP2
reduces once per minibatch (its last microbatch), odc pushes every microbatch, as in training.

On the GPU: 2 ranks (--ranks), NCCL for FSDP2 and a device odc.Comm. Where ranks must share a
GPU (fewer GPUs than ranks), NCCL refuses them: FSDP2's group is then torch's "fake" process group,
whose collectives return at once and move nothing, so FSDP2's host time lacks only NCCL's own
launch cost (a lower bound: odc / FSDP2 ratios are conservative) and its loss is meaningless; the
odc arm runs as in training, over CUDA IPC between the ranks sharing the device. On the
CPU (no GPU, or --cpu): gloo and a host odc.Comm, the tiny width with the preset's layer count
(the arithmetic is small, the per-layer host work is what is left); there the collectives are
host time too, so only the arms' difference and the profile mean anything.

  python dev/gpu/host_floor.py [--preset 1.5b] [--tokens 512,2048,8192,32768]
      [--microbatches 4] [--minibatches 3] [--arms fsdp2,odc] [--compile on|off|both]
      [--profile] [--cpu] [--rounds N] [--attribute] [--ranks N] [--kernels]
      [--checkpoint-inside]

The loss column is the warm-up minibatch's mean token loss (rank 0): the same data in every arm
and mode, so compiled and eager, FSDP2 and odc must agree to bf16's precision. "warm-up s" is
that minibatch's time, compilation included.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

import odc


def _build(preset: str, on_cpu: bool):
    """odc.train's model: the preset, or on the CPU the tiny width with the preset's layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc.train import model as train_model

    if not on_cpu:
        return train_model.build_model(preset)
    train_model.register_packed_attention()
    layers = train_model.PRESETS[preset]["num_hidden_layers"]
    shape = dict(train_model.PRESETS["tiny"], num_hidden_layers=layers)
    config = Qwen2Config(**shape, max_position_embeddings=131072, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM._from_config(config, attn_implementation=train_model.ATTENTION_NAME)
    return train_model.PackedCausalLM(lm)


def _union_seconds(intervals) -> float:
    """Seconds covered by (start_us, end_us) intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / 1e6


def _is_data_movement(name: str) -> bool:
    """Kernels that move bytes between ranks or buffers rather than compute: NCCL's and odc's
    (which may spin waiting for a peer), and copies and fills."""
    return "nccl" in name.lower() or "odc::" in name or name.startswith(("Memcpy", "Memset"))


def _busy_seconds(run, kernels=None):
    """(compute, data movement): how long the GPU ran `run`'s kernels, as the union of their
    intervals on the device's timeline (torch's profiler), compute kernels apart from NCCL's and
    odc's transfers and copies. A sum of kernel times would count overlapping streams twice and
    a collective's wait for its peers as work. With a dict `kernels`, also adds there per kernel
    name (data movement by name, compute as one row) [count, summed microseconds]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    compute, moving = [], []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            span = (event.time_range.start, event.time_range.end)
            is_moving = _is_data_movement(event.name)
            (moving if is_moving else compute).append(span)
            if kernels is not None:
                row = kernels.setdefault(event.name[:60] if is_moving else "(compute)", [0, 0.0])
                row[0] += 1
                row[1] += span[1] - span[0]
    return _union_seconds(compute), _union_seconds(moving)


def _checkpointed_block_forward(layer, *args, **kwargs):
    """A block's forward inside torch's checkpoint, compiled as one function (--checkpoint
    inside: the block's own checkpointing turned off, type(layer).forward runs it as is)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    forward = functools.partial(type(layer).forward, layer)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _compile_checkpoint_inside(model) -> None:
    """odc.train's compile_blocks (dynamic token dimension) with the checkpoint inside the compiled
    function instead of around the block's __call__ (docs/benchmarks.md, section 5)."""
    import types

    import torch._dynamo.config as dynamo_config

    from odc.train.model import RECOMPILE_LIMIT

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    for layer in model.layers:
        layer.gradient_checkpointing = False
        layer.forward = torch.compile(
            types.MethodType(_checkpointed_block_forward, layer), dynamic=True
        )


# Where the two arms' code differs, timed on whatever thread runs it (the autograd engine's device
# thread runs the backward's hooks): name -> (owner, attribute). FSDP2's collectives are looked up
# through torch.distributed at each call; odc.torch's hooks are closures made by module functions
# at engine construction and at each minibatch_begin, so their factories are wrapped in
# odc.torch._group, the module whose GroupState looks them up by name when it makes a hook.
# Parts inside FSDP2's reduce (foreach_reduce) are timed too, and also counted in it: its copy-in
# (the gradients into one flat buffer), making a sharded .grad (FSDP2, where .grad was None) or
# absorbing its add into the placeholder .grad (odc), the push, the buffers' allocation. A
# group's post-backward (every group, every microbatch, holding its reduce where there is one)
# contains them all: odc's groups push from there without foreach_reduce (_fsdp2_internals R12).
_FSDP2_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_TIMED = {
    "fsdp2": {
        "gather": ("torch.distributed", "all_gather_into_tensor"),
        "reduce-scatter": ("torch.distributed", "reduce_scatter_tensor"),
        "FSDP2 reduce": ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "foreach_reduce"),
        "post-backward": (
            "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup",
            "post_backward",
        ),
        "in reduce: copy-in": (_FSDP2_COLLECTIVES, "foreach_reduce_scatter_copy_in"),
        "in reduce: sharded .grad": (
            "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam",
            "to_sharded_dtensor",
        ),
    },
    "odc": {
        "gather": ("odc.torch._collectives.OdcAllGather", "__call__"),
        "push": ("odc.torch._collectives.OdcReduceScatter", "push"),
        "FSDP2 reduce": ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "foreach_reduce"),
        "in reduce: copy-in": (_FSDP2_COLLECTIVES, "foreach_reduce_scatter_copy_in"),
        "in reduce: placeholder": ("odc.torch._sums_pending.SumsPending", "__torch_dispatch__"),
        "in reduce: allocate": ("odc.torch._collectives.OdcReduceScatter", "allocate"),
        "odc hooks": [
            ("odc.torch._group", "_unsharded_watcher"),
            ("odc.torch._group", "_slot_marker"),
            ("odc.torch._group", "_grad_replacer"),
        ],
    },
}


def _owner(path: str):
    import importlib

    module, _, attribute = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), attribute)


def _timed(function, totals: dict, name: str):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

    return timed


def _time_differences(arm: str, totals: dict) -> None:
    """Wraps the arm's differing code (_TIMED) so that its host seconds add up in `totals`."""
    for name, places in _TIMED[arm].items():
        for path, attribute in places if isinstance(places, list) else [places]:
            owner = _owner(path)
            original = getattr(owner, attribute)
            if name == "odc hooks":  # a factory: time the hook it makes

                def factory(*args, _make=original, **kwargs):
                    return _timed(_make(*args, **kwargs), totals, "odc hooks")

                setattr(owner, attribute, factory)
            elif getattr(original, "__self__", None) is owner:  # a classmethod: stays unbound
                setattr(owner, attribute, staticmethod(_timed(original, totals, name)))
            else:
                setattr(owner, attribute, _timed(original, totals, name))


def _rank(rank, world_size, key, store, arm, preset, tokens_list, microbatches, minibatches,
          profile, on_cpu, compiled, attribute, kernels=False,
          checkpoint_inside=False):  # fmt: skip
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc.torch
    from odc.train.model import shard_blocks

    sharing = not on_cpu and world_size > torch.cuda.device_count()
    if on_cpu:
        torch.set_num_threads(1)
        backend, device, gpu = "gloo", torch.device("cpu"), None
    else:
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        backend, device = "gloo" if sharing else "nccl", torch.device("cuda", gpu)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    shard_options = {}
    if sharing and arm == "fsdp2":  # NCCL refuses two ranks on one GPU: collectives that do nothing
        import importlib

        from torch.distributed.device_mesh import DeviceMesh

        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"
        shard_options["mesh"] = DeviceMesh.from_group(dist.new_group(backend="fake"), "cuda")
    totals: dict = {}  # --attribute: host seconds in the arms' differing code, by part
    if attribute:
        _time_differences(arm, totals)
    try:
        with torch.device(device):
            model = _build(preset, on_cpu)
        model.gradient_checkpointing_enable()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The blocks compiled after fully_shard, as odc.train does.
        inside = checkpoint_inside and compiled and not on_cpu
        compiled = shard_blocks(
            model, compile=compiled and not inside, mp_policy=policy, **shard_options
        )
        if inside:
            _compile_checkpoint_inside(model)
            compiled = True
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        # Lines the ranks up before each measured microbatch (a group of its own, which odc.torch
        # is told of: a collective inside a minibatch is otherwise refused).
        align = dist.new_group(backend="gloo")
        engine = None
        if arm == "odc":
            comm = odc.Comm(rank, world_size, key, timeout=300, device=gpu)
            engine = odc.torch.OdcFSDP(model, comm, optimizer)
            engine.allow_collectives(align)
            if attribute:  # odc's groups push from their own post_backward (R12): time it there
                for module in model.modules():
                    group = getattr(module, "_get_fsdp_state", lambda: None)()
                    group = getattr(group, "_fsdp_param_group", None)
                    if group is not None and "post_backward" in vars(group):
                        group.post_backward = _timed(group.post_backward, totals, "post-backward")
        generator = torch.Generator().manual_seed(rank)
        vocab = model.config.vocab_size
        sync = (lambda: None) if on_cpu else torch.cuda.synchronize
        rows = {}
        profile_text = None
        for tokens in tokens_list:
            positions = torch.arange(tokens, device=device)
            boundaries = torch.tensor([0, tokens], dtype=torch.int32, device=device)

            losses = []  # the warm-up minibatch's: the same data in every arm and mode

            def microbatch():
                ids = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
                loss_sum = model(ids, positions, torch.roll(ids, -1), boundaries, tokens)
                (loss_sum / (tokens * microbatches)).backward()
                if not measuring:
                    losses.append(loss_sum.detach())

            walls, hosts, busy = [], [], []  # busy: (compute, moving) seconds
            kernel_rows = {} if kernels and rank == 0 else None  # the profiled microbatches
            parts = []  # per measured microbatch: {part: host seconds}

            def run_minibatch(measure: bool):
                if engine is not None:
                    engine.minibatch_begin()
                else:
                    model.set_requires_gradient_sync(False)
                for index in range(microbatches):
                    if engine is None and index == microbatches - 1:
                        model.set_requires_gradient_sync(True)
                    sync()
                    dist.barrier(group=align)  # ranks start each microbatch together
                    started = time.perf_counter()
                    if measure and not on_cpu and index == 0:
                        busy.append(_busy_seconds(microbatch, kernel_rows))
                        continue
                    before = dict(totals)
                    microbatch()
                    returned = time.perf_counter()
                    sync()
                    if measure:
                        hosts.append(returned - started)
                        walls.append(time.perf_counter() - started)
                        parts.append({k: v - before.get(k, 0.0) for k, v in totals.items()})
                if engine is not None:
                    engine.minibatch_end()
                optimizer.step()
                optimizer.zero_grad()

            measuring = False
            started = time.perf_counter()
            run_minibatch(False)  # warm-up: lazy initialization, allocations, first kernels
            warm_up_seconds = time.perf_counter() - started
            measuring = True
            profiler = cProfile.Profile() if profile and rank == 0 else None
            if profiler is not None:
                profiler.enable()
            for _ in range(minibatches):
                run_minibatch(True)
            if profiler is not None:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
                profile_text = (profile_text or "") + f"--- {tokens} tokens\n" + text.getvalue()
            if kernel_rows:
                lines = [
                    f"--- {tokens} tokens, kernels per profiled microbatch (rank 0): count, ms"
                ]
                for name, (count, us) in sorted(kernel_rows.items(), key=lambda r: -r[1][1]):
                    lines.append(
                        f"  {count / minibatches:8.1f} {us / 1e3 / minibatches:9.2f}  {name}"
                    )
                profile_text = (profile_text or "") + "\n".join(lines) + "\n"
            loss = sum(float(x) for x in losses) / (tokens * len(losses))
            rows[tokens] = (walls, hosts, busy, loss, warm_up_seconds, parts)
        return rows, profile_text, compiled
    finally:
        dist.destroy_process_group()


def _ms(values):
    return f"{statistics.median(values) * 1e3:9.1f}" if values else f"{'-':>9}"


def _spread(values):
    if len(values) < 2:
        return f"{'-':>13}"
    return f"{min(values) * 1e3:6.1f}-{max(values) * 1e3:<6.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1.5b", choices=["tiny", "0.5b", "1.5b", "7b"])
    parser.add_argument("--tokens", default="512,2048,8192,32768")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=3)
    parser.add_argument("--arms", default="fsdp2,odc")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--compile",
        choices=["on", "off", "both"],
        default="on",
        help="compile the decoder blocks as odc.train --compile does (GPU only; off: eager, "
        "odc.train's default; both: each arm eager, then compiled)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also list the profiled microbatch's kernels (rank 0): NCCL's, odc's and the copies "
        "by name, compute as one row; count and device ms per microbatch",
    )
    parser.add_argument(
        "--checkpoint-inside",
        action="store_true",
        help="compiled blocks with torch's checkpoint inside the compiled function instead of "
        "around the block (an experiment: docs/benchmarks.md, section 5)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="ranks (at least 2: odc.torch needs 2; more than GPUs: they share, see above)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the arms this many times, alternating (a fresh pair of processes each), and "
        "pool their microbatches",
    )
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="also time the code where the arms differ (gathers, the reduce-scatter or push, "
        "FSDP2's reduce bookkeeping, odc.torch's hooks) per microbatch",
    )
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ("fsdp2", "odc") for a in arms):
        parser.error(f"--arms: a list of fsdp2 and odc, got '{args.arms}'")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: a list of token counts, got '{args.tokens}'")
    if any(t < 2 for t in tokens) or args.microbatches < 2 or args.minibatches < 1:
        parser.error("--tokens >= 2 each, --microbatches >= 2, --minibatches >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    on_cpu = args.cpu or not torch.cuda.is_available()
    ranks = args.ranks
    if ranks < 2:
        parser.error(f"--ranks: at least 2 (odc.torch needs 2), got {ranks}")
    where = "CPU (tiny width)" if on_cpu else torch.cuda.get_device_name(0)
    if not on_cpu and ranks > torch.cuda.device_count():
        where += (
            f" x{torch.cuda.device_count()}, ranks sharing; FSDP2's collectives fake (free, "
            "no data: its loss is meaningless), timings a same-GPU comparison"
        )
    print(
        f"one microbatch, preset {args.preset}, {ranks} rank(s) on {where}, {args.microbatches} "
        f"microbatches x {args.minibatches} minibatches per size; ms, median (min-max)"
    )
    print(
        f"{'arm':6} {'blocks':8} {'tokens':>7} {'wall':>9} {'spread':>13} {'host':>9} "
        f"{'spread':>13} {'compute':>9} {'moving':>9} {'warm-up s':>9} {'loss':>8}"
    )
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    # cells[arm, blocks, size]: every rank's rows of every round, pooled; rounds alternate the
    # arms (fsdp2, odc, fsdp2, odc, ...) so that a slow spell of the shared host lands on both.
    cells, round_means, blocks_of = {}, {}, {}
    for compiled in modes:
        for round_index in range(args.rounds):
            for arm in arms:
                with tempfile.TemporaryDirectory() as folder:
                    out = odc.launch(
                        _rank, ranks, os.path.join(folder, "store"), arm, args.preset, tokens,
                        args.microbatches, args.minibatches, args.profile, on_cpu, compiled,
                        args.attribute, args.kernels, args.checkpoint_inside, timeout=3000,
                    )  # fmt: skip
                blocks = blocks_of[compiled] = "compiled" if out[0][2] else "eager"
                for size in tokens:
                    cell = cells.setdefault((arm, blocks, size), [[], [], [], [], [], []])
                    for rows, _, _ in out:
                        for column in (0, 1, 2, 5):
                            cell[column].extend(rows[size][column])
                    cell[3].append(out[0][0][size][3])
                    cell[4].append(out[0][0][size][4])
                    hosts = [h for rows, _, _ in out for h in rows[size][1]]
                    round_means[arm, blocks, size, round_index] = statistics.fmean(hosts)
                    # As it goes: a run cut short by a time limit still shows its finished rounds.
                    parts = [p for rows, _, _ in out for p in rows[size][5]]
                    names = sorted({name for part in parts for name in part})
                    split = ", ".join(
                        f"{n} {sum(p.get(n, 0.0) for p in parts) / len(parts) * 1e3:.2f}"
                        for n in names
                    )
                    print(
                        f"  round {round_index + 1} {arm:6} {blocks:8} {size:7d}: host ms mean "
                        f"{statistics.fmean(hosts) * 1e3:.1f}, median {_ms(hosts).strip()}"
                        f"{'; ' + split if split else ''}",
                        flush=True,
                    )
                if out[0][1]:
                    print(f"=== {arm} ({blocks}), round {round_index + 1}, rank 0, profiles")
                    sys.stdout.write(out[0][1])
    for (arm, blocks, size), (walls, hosts, busy, losses, warm_ups, _) in cells.items():
        compute, moving = [b[0] for b in busy], [b[1] for b in busy]
        print(
            f"{arm:6} {blocks:8} {size:7d} {_ms(walls)} {_spread(walls)} {_ms(hosts)} "
            f"{_spread(hosts)} {_ms(compute)} {_ms(moving)} {warm_ups[0]:9.1f} {losses[0]:8.4f}"
        )
    for blocks in [blocks_of[c] for c in modes]:
        if not all(("fsdp2", blocks, s) in cells and ("odc", blocks, s) in cells for s in tokens):
            continue
        print(f"odc / fsdp2 host time per microbatch ({blocks}); mean of every microbatch "
              "(FSDP2's reduce in its last one), then each round's ratio of means:")  # fmt: skip
        for size in tokens:
            mean = {arm: statistics.fmean(cells[arm, blocks, size][1]) for arm in arms}
            each = [
                round_means["odc", blocks, size, r] / round_means["fsdp2", blocks, size, r]
                for r in range(args.rounds)
            ]
            print(
                f"  {size:7d} tokens: {mean['odc'] / mean['fsdp2']:.3f} "
                f"(rounds: {', '.join(f'{x:.3f}' for x in each)})"
            )
    if args.attribute:
        print(
            "host ms per microbatch (mean) in the code where the arms differ, on any thread; "
            "the rest (the model, FSDP2's copy-in, casts and copy-out) is the same code:"
        )
        for (arm, blocks, size), cell in cells.items():
            parts = cell[5]
            names = sorted({name for part in parts for name in part})
            text = ", ".join(
                f"{name} {sum(p.get(name, 0.0) for p in parts) / len(parts) * 1e3:.2f}"
                for name in names
            )
            print(f"  {arm:6} {blocks:8} {size:7d}: {text or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
