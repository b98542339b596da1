"""One rank of an `odc train` run: FSDP2 over a Qwen2 model, collective (plain FSDP2) or ODC,
microbatches from the planner, timed per microbatch and per minibatch.

Invariant: every rank runs the same minibatches in the same order; under `collective` every rank
also runs the same number of microbatches (LB-Micro pads with empty ones, which still join FSDP2's
collectives through a zero-weighted 1-token forward), under `odc` the counts may differ.

Timing: on GPUs, CUDA events around every microbatch, read once per minibatch, so the host never
waits inside a minibatch and queues work ahead as in real training; on the CPU, the wall clock.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np

from ..errors import InvalidArgument


@dataclass
class RunConfig:
    preset: str
    comm: str  # "collective" | "odc"
    policy: str  # "local-sort" | "lb-micro" | "lb-mini"
    lengths: List[int]
    device: str  # "cpu" | "cuda"
    steps: int
    samples_per_rank: int
    max_tokens: int
    store_path: str
    lr: float = 1e-4
    warmup_steps: int = 1
    activation_checkpointing: bool = True
    # The planner's cost model (a, b, c): c + sum(a*L + b*L^2) seconds per microbatch. None: fit
    # it to single-sample microbatches timed on this model before planning (calibrate.py).
    cost: Optional[tuple] = None
    seed: int = 0
    token_ids_path: Optional[str] = None  # JSONL token ids instead of synthetic ones
    # (replicate, shard): FSDP2 HSDP on a 2-D mesh, ODC inside each replica and one all-reduce
    # across replicas per minibatch; None: a 1-D mesh over all ranks (flat).
    mesh: Optional[tuple] = None
    # "auto": the planner may split an outlier over a group of ranks (issue #14): the members run
    # their chunk first in the minibatch, exchanging K/V per layer within the group.
    split: str = "off"
    # How split groups exchange K/V: "nccl", an all-gather in a torch.distributed subgroup (NCCL
    # on GPUs, gloo on the CPU); "odc", an odc sub-communicator per group (odc.torch.split;
    # needs comm "odc", whose communicator it is split from).
    kv_exchange: str = "nccl"
    # How large LB-Mini may make a microbatch: "lb-micro" (no larger than LB-Micro's largest in
    # the same minibatch: no more activation memory) or "cap" (up to max_tokens; odc.plan).
    microbatch_memory: str = "lb-micro"
    # "adamw": torch's AdamW as constructed by default (foreach kernels on GPUs); "adamw-fused":
    # fused=True, a handful of kernel launches per step (under ODC the step is launched only once
    # the minibatch has ended on the GPU, check_minibatch, so its launch time is GPU idle time).
    optimizer: str = "adamw"
    # Where to write a torch.profiler trace of the last measured minibatch, one file per rank
    # (None: no profiling). The profiler slows that minibatch: its timings are kept out of the
    # results (the minibatch runs once more after the measured ones).
    profile_dir: Optional[str] = None


# The SMs odc's data kernels size their grids for in training (ODC_CUDA_SMS; docs/runtime.md).
TRAINING_SM_BUDGET = 32


@dataclass
class RankRecord:
    """What one rank measured in one minibatch (seconds, relative to the minibatch start)."""

    busy: float
    span: float
    microbatches: List[tuple] = field(default_factory=list)  # (start, end, tokens)
    # Per microbatch, in the same order: what it held and the host seconds its forward and
    # backward took to enqueue (a microbatch whose host time reaches its GPU time is bound by
    # the host: kernel launches, not compute). {"lengths": [...]} for a packed microbatch,
    # {"split": {"length", "pieces", "members"}} for a split sample's chunk.
    details: List[dict] = field(default_factory=list)
    replica_reduce: float = 0.0  # ODC on an HSDP mesh: the cross-replica all-reduce's seconds
    replica_reduce_bytes: int = 0  # ... and the fp32 gradient bytes this rank all-reduced
    # Host seconds of each call after the last microbatch (where a minibatch's tail goes; the
    # host blocks in "step" while check_minibatch waits for the GPU, in "sync" for the rest).
    tail_phases: dict = field(default_factory=dict)


class _Clock:
    """Timestamps in stream order (CUDA events) or wall time (CPU); read after a synchronize."""

    def __init__(self, on_gpu: bool):
        import torch

        self.on_gpu = on_gpu
        self._torch = torch

    def mark(self):
        if not self.on_gpu:
            return time.perf_counter()
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.on_gpu:
            self._torch.cuda.synchronize()

    def seconds(self, begin, end) -> float:
        if not self.on_gpu:
            return end - begin
        return begin.elapsed_time(end) / 1000.0


class _Trainer:
    """The sharded model, its optimizer and (under odc) the OdcFSDP engine, running microbatches."""

    def __init__(self, model, optimizer, engine, device):
        self.model, self.optimizer, self.engine, self.device = model, optimizer, engine, device

    def _to_device(self, array: np.ndarray):
        import torch

        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def microbatch(self, packed, global_tokens: int, split=None):
        """Forward and backward of one packed microbatch (or, with `split`, this rank's chunk of a
        split sample, run together with the other members); returns the detached scaled loss."""
        import odc.torch

        loss_sum = self.model(
            self._to_device(packed.input_ids),
            self._to_device(packed.position_ids),
            self._to_device(packed.labels),
            self._to_device(packed.boundaries),
            packed.longest,
            split=split,
        )
        loss = odc.torch.scale_loss(loss_sum, global_tokens)
        loss.backward()  # an empty (padding) microbatch has no labels: loss 0
        return loss.detach()

    def begin(self) -> None:
        if self.engine is not None:
            self.engine.minibatch_begin()

    def end(self) -> None:
        if self.engine is not None:
            self.engine.minibatch_end()


def _calibrate(
    trainer, clock, max_tokens: int, vocab_size: int, world_size: int, seed: int, label=None
):
    """Times single-sample microbatches of calibrate.ladder(max_tokens), and one of
    calibrate.floor_length(max_tokens) tokens for the floor, on every rank (one untimed, then the
    median of two), averages over ranks and fits the cost model; every rank gets the same (a, b,
    c, floor), so every rank computes the same plan. No optimizer step: the weights stay as
    initialized."""
    import torch
    import torch.distributed as dist

    from .calibrate import MIN_FIT_TOKENS, fit_cost_with_floor, floor_length, ladder
    from .data import pack, synthetic_tokens
    from .progress import Progress

    if max_tokens < MIN_FIT_TOKENS:
        return (1.0, 0.0, 0.0, 0.0), []  # nothing to fit: balance tokens
    lengths = [floor_length(max_tokens)] + ladder(max_tokens)
    documents = synthetic_tokens(lengths, vocab_size, seed=seed + 1)
    trainer.begin()
    medians = []
    progress = Progress(len(lengths), label or "", enabled=label is not None).start()
    for document, length in zip(documents, lengths):
        packed = pack([document])
        trainer.microbatch(packed, world_size * length)  # untimed: allocator growth, autotuning
        times = []
        for _ in range(2):
            clock.sync()
            begin = clock.mark()
            trainer.microbatch(packed, world_size * length)
            end = clock.mark()
            clock.sync()
            times.append(clock.seconds(begin, end))
        medians.append(float(np.median(times)))
        progress.update(f"{length} tokens: {medians[-1]:.3g} s")
    progress.close()
    trainer.end()
    trainer.optimizer.zero_grad(set_to_none=True)
    seconds = torch.tensor(medians, dtype=torch.float64, device=trainer.device)
    dist.all_reduce(seconds)
    mean = (seconds / world_size).tolist()
    return fit_cost_with_floor(lengths[1:], mean[1:], mean[0]), list(zip(lengths, mean))


def _device_mesh(config: RunConfig, world_size: int, device):
    """The HSDP mesh (replicate, shard) of config.mesh, or None for FSDP2's default 1-D mesh."""
    if config.mesh is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = config.mesh
    if replicas * shards != world_size:
        raise InvalidArgument(f"mesh {replicas}x{shards} does not cover the {world_size} ranks")
    return init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


def run_rank(rank: int, world_size: int, key: Optional[str], config: RunConfig) -> Optional[dict]:
    """One rank of one run. Self-launched (odc.launch): joins through config.store_path and
    the odc key given. Under torchrun (the process group already initialized, key None): uses
    that group, LOCAL_RANK's GPU and a communicator from the group (comm_from_process_group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc
    import odc.torch

    from .data import load_token_ids, pack, pack_chunk, schedule, synthetic_tokens
    from .memory import MemoryProbe
    from .metrics import describe_cost
    from .model import build_model
    from .progress import Progress

    on_gpu = config.device == "cuda"
    if config.kv_exchange not in ("nccl", "odc"):
        raise InvalidArgument(f"kv_exchange must be 'nccl' or 'odc', got {config.kv_exchange!r}")
    if config.kv_exchange == "odc" and config.comm != "odc":
        raise InvalidArgument("the odc K/V exchange (kv_exchange 'odc') needs comm 'odc'")
    if config.kv_exchange == "odc" and config.mesh is not None:
        raise InvalidArgument("the odc K/V exchange (kv_exchange 'odc') needs a flat mesh")
    external_group = dist.is_initialized()  # torchrun: the caller owns the process group
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if external_group else rank
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(local_rank)
    if not external_group:
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"file://{config.store_path}",
            rank=rank,
            world_size=world_size,
            device_id=device if on_gpu else None,
        )
    probe = MemoryProbe(on_gpu)
    try:
        with device:  # initialize on the device: a 7B model initialized on the CPU takes minutes
            model = build_model(config.preset, seed=config.seed)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable()
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if on_gpu else None,
            reduce_dtype=torch.float32 if on_gpu else None,
        )
        mesh = _device_mesh(config, world_size, device)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            **({"fused": True} if config.optimizer == "adamw-fused" else {}),
        )
        engine = None
        if config.comm == "odc":
            device_index = local_rank if on_gpu else None
            if on_gpu:
                # odc's gather and push kernels overlap forward/backward here: sized for every SM
                # they slowed the compute beside them (balanced 8K microbatches on 4 H200s: 0.399
                # s with all 132 SMs, 0.391 s with 32 or 16; docs/benchmarks.md, SM budget). The
                # user's own setting wins.
                os.environ.setdefault("ODC_CUDA_SMS", str(TRAINING_SM_BUDGET))
            if key is None:  # torchrun: the job's process group (its shard group on HSDP meshes)
                group = mesh.get_group("shard") if mesh is not None else None
                comm = odc.torch.comm_from_process_group(group, timeout=600)
            elif mesh is None:
                comm = odc.Comm(rank, world_size, key, timeout=600, device=device_index)
            else:  # one communicator per replica ("node")
                comm = odc.torch.node_comm(mesh, key, timeout=600, device=device_index)
            engine = odc.torch.OdcFSDP(model, comm, optimizer)
        else:
            odc.torch.sum_gradients(model)  # the same sums as ODC (the loss is pre-scaled)
        trainer = _Trainer(model, optimizer, engine, device)
        clock = _Clock(on_gpu)

        vocab_size = model.config.vocab_size
        if config.token_ids_path:
            samples = load_token_ids(config.token_ids_path)
            largest = max(int(s.max()) for s in samples)
            if largest >= vocab_size:
                raise InvalidArgument(
                    f"'{config.token_ids_path}' holds token id {largest}, beyond the "
                    f"{config.preset} preset's vocabulary of {vocab_size}"
                )
        else:
            samples = synthetic_tokens(config.lengths, vocab_size, seed=config.seed)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        probe.enter("setup")
        cost, calibration = config.cost, []
        if cost is None:
            label = f"[{config.comm} {config.policy}] cost fit, one sample per microbatch"
            cost, calibration = _calibrate(
                trainer,
                clock,
                config.max_tokens,
                vocab_size,
                world_size,
                config.seed,
                label if rank == 0 else None,
            )
            if rank == 0:
                print(
                    f"[{config.comm} {config.policy}] fitted cost: {describe_cost(cost)} per "
                    "microbatch",
                    file=sys.stderr,
                    flush=True,
                )
        plan = schedule(
            config.lengths,
            ranks=world_size,
            samples_per_minibatch=world_size * config.samples_per_rank,
            max_tokens=config.max_tokens,
            policy=config.policy,
            cost=cost,
            split=config.split,
            microbatch_memory=config.microbatch_memory,
        )
        num_steps = min(config.steps + config.warmup_steps, len(plan["minibatches"]))
        splits = _split_groups(config, plan["minibatches"][:num_steps], model, engine, on_gpu)
        records, losses = [], []
        # Everything built so far lives until the end: keep it out of the collector's scans, or a
        # full collection (timed by allocation counts, so at the same minibatch every run) lands
        # inside a measured minibatch.
        gc.collect()
        gc.freeze()
        steps_progress = Progress(
            num_steps,
            f"[{config.comm} {config.policy}] minibatches ({config.warmup_steps} warm-up)",
            enabled=rank == 0,
        ).start()
        # With profile_dir, the last measured minibatch runs once more under the profiler, after
        # the measured ones (its timings are not kept: the profiler slows it).
        profiled_step = num_steps - 1 if config.profile_dir and num_steps > 0 else None
        runs = list(range(num_steps)) + ([profiled_step] if profiled_step is not None else [])
        for run_index, step in enumerate(runs):
            profiling = run_index >= num_steps
            profiler = _start_profiler(torch, on_gpu) if profiling else None
            minibatch = plan["minibatches"][step]
            global_tokens = sum(len(samples[i]) - 1 for i in minibatch["samples"])
            mine = minibatch["ranks"][rank]["microbatches"]
            clock.sync()
            dist.barrier()  # a common start: the span covers everything after it
            start_wall = time.perf_counter()
            start = clock.mark()
            marks, details = [], []
            step_loss = torch.zeros((), device=device)
            probe.enter("minibatch_begin")
            trainer.begin()
            # Split chunks first (docs/design.md, "Splitting outliers"): the members meet at the
            # start of the minibatch and no member waits for another's unrelated work; groups are
            # disjoint.
            for split in minibatch.get("splits", []):
                chunk = splits.chunk(split)
                if chunk is None:  # not a member
                    continue
                sample = samples[split["sample"]]
                packed = pack_chunk(sample, chunk.pieces)
                chunk.prefetch(device)  # its index tensors, before its clock starts (as packing)
                begin, host = clock.mark(), time.perf_counter()
                step_loss += trainer.microbatch(packed, global_tokens, split=chunk)
                host = time.perf_counter() - host
                marks.append((begin, clock.mark(), packed.num_tokens))
                details.append(
                    {
                        "split": {
                            "length": len(sample),
                            "pieces": [list(p) for p in chunk.pieces],
                            "members": chunk.members,
                        },
                        "host_seconds": host,
                    }
                )
            for microbatch in mine:
                packed = pack([samples[i] for i in microbatch])
                probe.enter("microbatch", packed.num_tokens)
                begin, host = clock.mark(), time.perf_counter()
                step_loss += trainer.microbatch(packed, global_tokens)
                host = time.perf_counter() - host
                marks.append((begin, clock.mark(), packed.num_tokens))
                details.append(
                    {"lengths": [len(samples[i]) for i in microbatch], "host_seconds": host}
                )
            probe.enter("end_and_step")
            tail = [time.perf_counter()]
            trainer.end()
            tail.append(time.perf_counter())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tail.append(time.perf_counter())
            optimizer.step()
            tail.append(time.perf_counter())
            optimizer.zero_grad()
            tail.append(time.perf_counter())
            clock.sync()
            tail.append(time.perf_counter())
            record = RankRecord(busy=0.0, span=tail[-1] - start_wall)
            record.tail_phases = {
                name: tail[i + 1] - tail[i]
                for i, name in enumerate(("end", "clip", "step", "zero_grad", "sync"))
            }
            if engine is not None and engine.replica_reduction is not None:
                record.replica_reduce = engine.replica_reduction.seconds
                record.replica_reduce_bytes = engine.replica_reduction.bytes_per_minibatch
            for begin, end, tokens in marks:
                record.microbatches.append(
                    (clock.seconds(start, begin), clock.seconds(start, end), tokens)
                )
                record.busy += clock.seconds(begin, end)
            record.details = details
            dist.all_reduce(step_loss)  # after the timed span
            if profiling:
                _write_profile(profiler, config, rank)
                continue
            losses.append(float(step_loss))
            records.append(record)
            steps_progress.update(f"{record.span:.3f} s, loss {losses[-1]:.4f}")
        steps_progress.close()
        memory = probe.summary()
        peak = memory.get("torch_peak_bytes", 0)
        if engine is not None:
            memory.update({f"odc_{k}_bytes": v for k, v in engine.memory_bytes().items()})
            peak += engine.symmetric_bytes
        exchange_bytes = splits.memory_bytes()
        splits.close()
        if exchange_bytes:  # the odc K/V exchange's symmetric buffers (not in torch's peak)
            memory["odc_kv_exchange_bytes"] = exchange_bytes
            peak += exchange_bytes
        # The streamed scheme's flow control (host transports): chunks sent, waits for credit.
        stream = comm.stream_stats() if engine is not None else None
        gathered = [None] * world_size
        dist.all_gather_object(gathered, ([asdict(r) for r in records], peak, memory, stream))
        if engine is not None:
            comm.close()
        if rank != 0:
            return None
        summary = _summary(config, plan, gathered, losses, num_steps, world_size)
        summary["cost"] = list(cost)
        if config.cost is not None:
            summary["cost_source"] = "given"
        else:
            summary["cost_source"] = "fitted" if calibration else "tokens (too short to fit)"
        summary["calibration"] = calibration
        # The breakdown of the rank with the largest peak (docs/benchmarks.md, memory).
        summary["memory"] = max((g for g in gathered), key=lambda g: g[1])[2]
        if engine is not None:
            summary["odc_stream_per_rank"] = [g[3] for g in gathered]
        return summary
    finally:
        # What this run froze becomes collectable again: under torchrun the next run of the same
        # command lives in this process (a frozen model kept 1.44 GiB of the 1.5b preset's
        # memory into the next run).
        gc.unfreeze()
        gc.collect()
        if not external_group:
            dist.destroy_process_group()


def _split_groups(config: RunConfig, minibatches, model, engine, on_gpu: bool):
    """The groups of the split samples of `minibatches` (odc.torch.split.SplitGroups), made on
    every rank before any timing: K/V through odc sub-communicators of the engine's comm
    ("odc"), or through torch.distributed subgroups ("nccl": NCCL on GPUs, gloo on the CPU)."""
    import torch

    from ..torch.split import SplitGroups

    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if config.kv_exchange == "odc":
        groups = SplitGroups(
            engine.comm,
            exchange="odc",
            kv_width=2 * text.num_key_value_heads * head_dim,  # K and V of one token
            dtype=torch.bfloat16 if on_gpu else torch.float32,
        )
    else:
        groups = SplitGroups(exchange="process-group", engines=[engine] if engine else [])
    groups.prepare([s for m in minibatches for s in m.get("splits", [])])
    return groups


def _start_profiler(torch, on_gpu: bool):
    """A running torch.profiler over CPU (and CUDA) activity, for one minibatch."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def _write_profile(profiler, config: RunConfig, rank: int) -> None:
    """Stops `profiler` and writes its Chrome trace (open in Perfetto or chrome://tracing) and a
    table of the operators with the most self time, per rank, into config.profile_dir."""
    profiler.stop()
    os.makedirs(config.profile_dir, exist_ok=True)
    name = f"{config.comm}_{config.policy}"
    if config.split == "auto":
        name += f"_split_kv-{config.kv_exchange}"
    if config.mesh is not None:
        name += f"_mesh{config.mesh[0]}x{config.mesh[1]}"
    base = os.path.join(config.profile_dir, f"{name}_rank{rank}")
    profiler.export_chrome_trace(base + ".json.gz")
    averages = profiler.key_averages()
    with open(base + ".txt", "w") as table:
        for sort in ("self_cuda_time_total", "self_cpu_time_total"):
            try:
                text = averages.table(sort_by=sort, row_limit=40)
            except (AttributeError, KeyError, ValueError):
                continue  # no CUDA column on the CPU
            table.write(f"sorted by {sort}\n{text}\n")


def _summary(config, plan, gathered, losses, num_steps, world_size) -> dict:
    from .metrics import MinibatchTiming, compare_prediction, predict_minibatch, summarize

    timings = []
    for step in range(config.warmup_steps, num_steps):
        per_rank = [gathered[r][0][step] for r in range(world_size)]
        minibatch = plan["minibatches"][step]
        timings.append(
            MinibatchTiming(
                busy_seconds=[p["busy"] for p in per_rank],
                span_seconds=max(p["span"] for p in per_rank),
                samples=len(minibatch["samples"]),
                tokens=sum(config.lengths[i] for i in minibatch["samples"]),
                microbatches=[len(p["microbatches"]) for p in per_rank],
            )
        )
    measured = summarize(timings)
    # The planner's prediction for the same minibatches, under this communication mode, on the
    # measurement's basis: time-weighted over minibatches, span against span (metrics.py).
    mode = "odc" if config.comm == "odc" else "collective"
    cost = tuple(plan["cost"][k] for k in ("a", "b", "c")) + (plan["cost"].get("floor", 0.0),)
    predicted = [
        predict_minibatch(
            plan["minibatches"][s]["ranks"],
            config.lengths,
            cost,
            mode,
            plan["minibatches"][s].get("splits", []),
        )
        for s in range(config.warmup_steps, num_steps)
    ]
    comparison = compare_prediction(timings, predicted)
    last = num_steps - 1
    return {
        "preset": config.preset,
        "comm": config.comm,
        "policy": config.policy,
        "split": config.split,
        "kv_exchange": config.kv_exchange if config.split == "auto" else None,
        "split_samples": sum(
            len(plan["minibatches"][s].get("splits", []))
            for s in range(config.warmup_steps, num_steps)
        ),
        "ranks": world_size,
        "device": config.device,
        "steps_measured": len(timings),
        "samples_per_rank": config.samples_per_rank,
        "max_tokens": config.max_tokens,
        "microbatch_memory": config.microbatch_memory,
        "optimizer": config.optimizer,
        "odc_cuda_sms": os.environ.get("ODC_CUDA_SMS") if config.comm == "odc" else None,
        **measured,
        # Under collective a rank's busy time includes its waits inside FSDP2's per-layer
        # collectives, so its measured bubble is near zero by construction, not a measurement of
        # idle time: compare step time (span) there instead.
        "bubble_measured": config.comm == "odc",
        **comparison,
        # The measured minibatches' sample lengths, in plan order: with the cost model, enough to
        # re-plan and re-simulate exactly these minibatches (dev/analysis/validate_runs.py).
        "warmup_steps": config.warmup_steps,
        "measured_lengths": [
            config.lengths[i]
            for s in range(config.warmup_steps, num_steps)
            for i in plan["minibatches"][s]["samples"]
        ],
        # Each measured minibatch's span (slowest rank): the spread the table reports.
        "minibatch_seconds": [t.span_seconds for t in timings],
        # Per measured minibatch, the longest host time of each call after the last microbatch
        # over the ranks (RankRecord.tail_phases).
        "tail_phase_seconds": [
            {
                name: max(
                    gathered[r][0][s]["tail_phases"].get(name, 0.0) for r in range(world_size)
                )
                for name in ("end", "clip", "step", "zero_grad", "sync")
            }
            for s in range(config.warmup_steps, num_steps)
        ],
        "peak_memory_bytes": max(gathered[r][1] for r in range(world_size)),
        "losses": losses,
        "timeline": [gathered[r][0][last]["microbatches"] for r in range(world_size)],
        # Every measured microbatch: [minibatch][rank] -> [{"start", "end", "tokens",
        # "host_seconds", "lengths" or "split"}] (RankRecord.details), enough to fit a cost model
        # to what ran (dev/analysis/microbatch_fit.py) or to find host-bound microbatches.
        "microbatch_log": [
            [
                [
                    {"start": m[0], "end": m[1], "tokens": m[2], **d}
                    for m, d in zip(gathered[r][0][s]["microbatches"], gathered[r][0][s]["details"])
                ]
                for r in range(world_size)
            ]
            for s in range(config.warmup_steps, num_steps)
        ],
        **_hybrid_summary(config, gathered, num_steps, world_size),
        "last_span_seconds": max(gathered[r][0][last]["span"] for r in range(world_size)),
        **_edges(config, gathered, num_steps, world_size),
    }


def _edges(config, gathered, num_steps, world_size) -> dict:
    """Where a minibatch's time goes outside forward+backward, mean over the measured ones:
    lead-in, from the common start to the last rank's first microbatch (minibatch_begin: under
    ODC, publishing the shards); tail, from the last microbatch's end on any rank to the end of
    the span (minibatch_end, gradient clipping, optimizer step). Both idle every GPU."""
    lead_in, tail = [], []
    for step in range(config.warmup_steps, num_steps):
        records = [gathered[r][0][step] for r in range(world_size)]
        firsts = [rec["microbatches"][0][0] for rec in records if rec["microbatches"]]
        lasts = [rec["microbatches"][-1][1] for rec in records if rec["microbatches"]]
        if firsts:
            lead_in.append(max(firsts))
            tail.append(max(rec["span"] for rec in records) - max(lasts))
    return {
        "lead_in_seconds": float(np.mean(lead_in)) if lead_in else 0.0,
        "tail_seconds": float(np.mean(tail)) if tail else 0.0,
    }


def _hybrid_summary(config, gathered, num_steps, world_size) -> dict:
    """The mesh, and for ODC on an HSDP mesh the cross-replica reduction: seconds per minibatch
    and the fp32 bytes each rank all-reduces. A rank's time runs from its node's sums being final
    to the reduction's end, so it includes waiting for slower nodes: the least over ranks (the
    last node to arrive) is the reduction itself; mean over the measured minibatches.
    Collective HSDP all-reduces inside every backward, interleaved with compute: not separable."""
    replicas, shards = config.mesh or (1, world_size)
    summary = {
        "mesh": [replicas, shards],
        "replica_reduce_seconds": None,
        "replica_reduce_bytes": 0,
    }
    if config.comm == "odc" and config.mesh is not None:
        steps = range(config.warmup_steps, num_steps)
        per_step = [
            min(gathered[r][0][s]["replica_reduce"] for r in range(world_size)) for s in steps
        ]
        summary["replica_reduce_seconds"] = float(np.mean(per_step)) if per_step else 0.0
        summary["replica_reduce_bytes"] = max(
            gathered[r][0][-1]["replica_reduce_bytes"] for r in range(world_size)
        )
    return summary


def default_store_path(directory: str) -> str:
    return os.path.join(directory, "store")
