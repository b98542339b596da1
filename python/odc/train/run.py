"""One rank of an `odc train` run: FSDP2 over a Qwen2 model, one of the arms of arms.py (plain
FSDP2, FSDP2 with deferred sync, FSDP2 unsharded, ODC), microbatches from the planner, timed per
microbatch and per minibatch.

Invariant: every rank runs the same minibatches in the same order; under `collective` and
`fsdp2-deferred` every rank also runs the same number of microbatches (LB-Micro and lb-mini-padded
pad with empty ones, which still join FSDP2's collectives through a zero-weighted 1-token forward),
under `fsdp2-unsharded` and `odc` the counts may differ.

Timing: on GPUs, CUDA events around every microbatch, read once per minibatch, so the host never
waits inside a minibatch and queues work ahead as in real training; on the CPU, the wall clock.
"""

from __future__ import annotations

import gc
import math
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
    comm: str  # arms.COMMS: "collective" | "fsdp2-deferred" | "fsdp2-unsharded" | "odc"
    policy: str  # arms.POLICIES: "local-sort" | "lb-micro" | "lb-mini" | "lb-mini-padded"
    lengths: List[int]
    device: str  # "cpu" | "cuda"
    steps: int
    samples_per_rank: int
    max_tokens: int
    store_path: str
    lr: float = 1e-4
    warmup_steps: int = 1
    activation_checkpointing: bool = True
    # Compile each decoder block (model.compile_blocks): less host time per microbatch than eager
    # PyTorch's floor (docs/benchmarks.md, "5. The host floor"). The command line turns it on by
    # default on GPUs (`--no-compile` turns it off); a RunConfig built in code asks for it.
    compile_blocks: bool = False
    # The planner's cost model (a, b, c): c + sum(a*L + b*L^2) seconds per microbatch. None: fit
    # it to single-sample and packed microbatches timed on this model before planning
    # (odc/_cost_fit.py).
    cost: Optional[tuple] = None
    seed: int = 0
    token_ids_path: Optional[str] = None  # JSONL token ids instead of synthetic ones
    # (replicate, shard): FSDP2 HSDP on a 2-D mesh, ODC inside each replica and one all-reduce
    # across replicas per minibatch; None: a 1-D mesh over all ranks (flat).
    mesh: Optional[tuple] = None
    # "auto": the planner may split an outlier over a group of ranks: the members run
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
    # ODC runs: claim microbatches through the work board (OdcFSDP.microbatches): a rank whose
    # planned microbatches are all claimed takes the last one of the rank with the most predicted
    # work left. The plan and the loss normalization stay the minibatch's.
    steal: bool = False
    # {rank: factor}: that rank runs factor times slower (--rank-slowdown): after each of its
    # microbatches it waits for its device and sleeps (factor - 1) x the microbatch's time, inside
    # the microbatch's timing (busy time, as a slower GPU's would be).
    rank_slowdown: dict = field(default_factory=dict)


# The SMs odc's data kernels size their grids for in training (odc.Comm's cuda_sms;
# docs/runtime.md). odc's gather and push kernels overlap forward/backward here: sized for every SM
# they slowed the compute beside them (balanced 8K microbatches on 4 H200s: 0.399 s with all 132
# SMs, 0.391 s with 32 or 16; docs/benchmarks-archive.md, SM budget).
TRAINING_SM_BUDGET = 32


def training_cuda_sms(config) -> Optional[int]:
    """The SM budget odc.train gives its GPU communicators: TRAINING_SM_BUDGET, unless the user set
    ODC_CUDA_SMS (theirs wins: the library reads it) or the run is on the CPU (None)."""
    if config.device != "cuda" or os.environ.get("ODC_CUDA_SMS"):
        return None
    return TRAINING_SM_BUDGET


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
    split_prepare: float = 0.0  # host seconds of SplitGroups.prepare (inside the span)
    replica_reduce: float = 0.0  # ODC on an HSDP mesh: the cross-replica all-reduce's seconds
    replica_reduce_bytes: int = 0  # ... and the fp32 gradient bytes this rank all-reduced
    # Host seconds of each call after the last microbatch (where a minibatch's tail goes; the
    # host blocks in "step" while check_minibatch waits for the GPU, in "sync" for the rest).
    tail_phases: dict = field(default_factory=dict)
    # FSDP2 arms: the all-gathers and reduce-scatters this rank issued in the minibatch (one per
    # FSDP2 unit each; arms.CollectiveCounter); empty under odc.
    collectives: dict = field(default_factory=dict)


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

    def microbatch(self, packed, global_tokens: int, split=None, objective=None, labels=None):
        """Forward and backward of one packed microbatch (or, with `split`, this rank's chunk of a
        split sample, run together with the other members); returns the detached scaled loss.
        `objective` and `labels` (a device tensor) replace the cross entropy on packed.labels
        (PackedCausalLM.forward; GRPO's clipped objective on response tokens)."""
        import odc.torch

        loss_sum = self.model(
            self._to_device(packed.input_ids),
            self._to_device(packed.position_ids),
            self._to_device(packed.labels) if labels is None else labels,
            self._to_device(packed.boundaries),
            packed.longest,
            split=split,
            **({} if objective is None else {"objective": objective}),
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
    """Times one microbatch of _cost_fit.floor_length(max_tokens) tokens for the floor,
    single-sample microbatches of _cost_fit.ladder(max_tokens) and the packed ones of
    _cost_fit.packed_ladder(max_tokens), on every rank (one untimed, then the median of two),
    averages over ranks and fits the cost model; every rank gets the same (a, b, c, floor), so
    every rank computes the same plan. Returns it and the calibration as recorded: [tokens,
    seconds] per rung, [tokens, seconds, documents] for a packed one (equal documents,
    odc._cost_fit.split_evenly), the floor's first. No optimizer step: the weights stay as
    initialized."""
    import torch
    import torch.distributed as dist

    from .._cost_fit import (
        MIN_FIT_TOKENS,
        fit_cost_with_floor,
        floor_length,
        ladder,
        packed_ladder,
    )
    from .data import pack, synthetic_tokens
    from .progress import Progress

    if max_tokens < MIN_FIT_TOKENS:
        return (1.0, 0.0, 0.0, 0.0), []  # nothing to fit: balance tokens
    rungs = [[floor_length(max_tokens)]] + [[n] for n in ladder(max_tokens)]
    rungs += packed_ladder(max_tokens)
    documents = iter(synthetic_tokens([n for r in rungs for n in r], vocab_size, seed=seed + 1))
    trainer.begin()
    medians = []
    progress = Progress(len(rungs), label or "", enabled=label is not None).start()
    for rung in rungs:
        packed = pack([next(documents) for _ in rung])
        tokens = sum(rung)
        trainer.microbatch(packed, world_size * tokens)  # untimed: allocator growth, autotuning
        times = []
        for _ in range(2):
            clock.sync()
            begin = clock.mark()
            trainer.microbatch(packed, world_size * tokens)
            end = clock.mark()
            clock.sync()
            times.append(clock.seconds(begin, end))
        medians.append(float(np.median(times)))
        shape = f"{tokens} tokens" + (f" in {len(rung)} documents" if len(rung) > 1 else "")
        progress.update(f"{shape}: {medians[-1]:.3g} s")
    progress.close()
    trainer.end()
    trainer.optimizer.zero_grad(set_to_none=True)
    seconds = torch.tensor(medians, dtype=torch.float64, device=trainer.device)
    dist.all_reduce(seconds)
    mean = (seconds / world_size).tolist()
    cost = fit_cost_with_floor(rungs[1:], mean[1:], mean[0])
    calibration = [[sum(r), s] + ([len(r)] if len(r) > 1 else []) for r, s in zip(rungs, mean)]
    return cost, calibration


def _device_mesh(config: RunConfig, world_size: int, device):
    """The HSDP mesh (replicate, shard) of config.mesh, or None for FSDP2's default 1-D mesh."""
    if config.mesh is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = config.mesh
    if replicas * shards != world_size:
        raise InvalidArgument(f"mesh {replicas}x{shards} does not cover the {world_size} ranks")
    return init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _check_config(config: RunConfig) -> None:
    from .arms import check_arm

    check_arm(config.comm, config.policy)
    if config.comm in ("fsdp2-deferred", "fsdp2-unsharded") and config.split != "off":
        raise InvalidArgument(f"comm {config.comm!r} runs without split samples (split 'off')")
    if config.kv_exchange not in ("nccl", "odc"):
        raise InvalidArgument(f"kv_exchange must be 'nccl' or 'odc', got {config.kv_exchange!r}")
    if config.kv_exchange == "odc" and config.comm != "odc":
        raise InvalidArgument("the odc K/V exchange (kv_exchange 'odc') needs comm 'odc'")
    if config.kv_exchange == "odc" and config.mesh is not None:
        raise InvalidArgument("the odc K/V exchange (kv_exchange 'odc') needs a flat mesh")
    if config.steal and config.mesh is not None:
        raise InvalidArgument("steal runs on a flat mesh only (mesh None)")
    if config.steal and config.comm != "odc":
        raise InvalidArgument(
            f"steal needs comm 'odc' ({config.comm} runs every rank's own microbatches in step)"
        )
    for rank, factor in config.rank_slowdown.items():
        if not (isinstance(rank, int) and rank >= 0 and math.isfinite(factor) and factor >= 1.0):
            raise InvalidArgument(
                f"rank_slowdown: expected {{rank: factor >= 1}}, got {{{rank!r}: {factor!r}}}"
            )


class Run:
    """One rank of one run, in phases, each readable on its own: `setup` (process group, sharded
    model, optimizer, ODC engine, samples), `plan` (cost model, schedule, split groups), `step`
    (one minibatch, timed), `collect` (memory, every rank's records, the summary on rank 0).
    `run_rank` drives them; `close` always runs.

    Self-launched (odc.launch): joins through config.store_path and the odc key given. Under
    torchrun (the process group already initialized, key None): uses that group, LOCAL_RANK's
    GPU and a communicator from the group (comm_from_process_group)."""

    def __init__(self, rank: int, world_size: int, key: Optional[str], config: RunConfig):
        _check_config(config)
        self.rank, self.world_size, self.key, self.config = rank, world_size, key, config
        self.on_gpu = config.device == "cuda"
        self.engine = self.comm = self.splits = None
        self.external_group = False
        self.records: List[RankRecord] = []
        self.losses: List[float] = []
        # Per minibatch, the total gradient norm clip_grad_norm_ saw (before clipping): equal in
        # every arm that sums the same gradients (the summary's agreement check).
        self.grad_norms: List[float] = []
        self._sample_lengths: Optional[List[int]] = None

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        from .arms import CollectiveCounter, GradientSync
        from .memory import MemoryProbe

        self._join_process_group()
        self.probe = MemoryProbe(self.on_gpu)
        self.model, self.optimizer, self.mesh = self._sharded_model()
        self.engine = self._odc_engine()
        self.sync = GradientSync(self.model, self.config.comm)
        self.counter = CollectiveCounter(self.model) if self.engine is None else None
        self.trainer = _Trainer(self.model, self.optimizer, self.engine, self.device)
        self.clock = _Clock(self.on_gpu)
        self.samples = self._samples()

    def _join_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        self.external_group = dist.is_initialized()  # torchrun: the caller owns the group
        env_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_rank = env_rank if self.external_group else self.rank
        self.device = torch.device("cuda", self.local_rank) if self.on_gpu else torch.device("cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.local_rank)
        if not self.external_group:
            dist.init_process_group(
                "nccl" if self.on_gpu else "gloo",
                init_method=f"file://{self.config.store_path}",
                rank=self.rank,
                world_size=self.world_size,
                device_id=self.device if self.on_gpu else None,
            )

    def _sharded_model(self):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from .model import build_model, shard_blocks

        config = self.config
        with self.device:  # initialize on the device: a 7B model on the CPU takes minutes
            model = build_model(config.preset, seed=config.seed)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable()
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if self.on_gpu else None,
            reduce_dtype=torch.float32 if self.on_gpu else None,
        )
        mesh = _device_mesh(config, self.world_size, self.device)
        # fsdp2-unsharded keeps every layer's parameters gathered from the minibatch's start to
        # its last backward (arms.GradientSync); the root never reshards after forward anyway.
        reshard = config.comm != "fsdp2-unsharded"
        # What happened, not what was asked: CUDA without flash attention runs the blocks eagerly.
        self.compiled_blocks = shard_blocks(
            model,
            compile=config.compile_blocks,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard,
        )
        if self.compiled_blocks and self.rank == 0:
            print(
                "odc.train: decoder blocks compiled (torch.compile, dynamic token count): the "
                "first microbatches of the run compile them, once (later runs reuse torch's "
                "on-disk cache)",
                file=sys.stderr,
                flush=True,
            )
        fused = {"fused": True} if config.optimizer == "adamw-fused" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, **fused)
        return model, optimizer, mesh

    def _odc_engine(self):
        """The OdcFSDP engine over a communicator of the run (None under the FSDP2 arms, where
        the gradients are summed as ODC sums them: the loss is pre-scaled)."""
        import odc
        import odc.torch

        if self.config.comm != "odc":
            odc.torch.sum_gradients(self.model)
            return None
        device_index = self.local_rank if self.on_gpu else None
        cuda_sms = training_cuda_sms(self.config)  # passed down, never set in the environment
        mesh = self.mesh
        self._size_nvshmem_heap()
        if self.key is None:  # torchrun: the job's process group (its shard group on HSDP)
            group = mesh.get_group("shard") if mesh is not None else None
            # model: across hosts (NVSHMEM) the heap is sized to it too.
            self.comm = odc.torch.comm_from_process_group(
                group, timeout=600, model=self.model, cuda_sms=cuda_sms
            )
        elif mesh is None:
            self.comm = odc.Comm(
                self.rank,
                self.world_size,
                self.key,
                timeout=600,
                device=device_index,
                cuda_sms=cuda_sms,
            )
        else:  # one communicator per replica ("node")
            self.comm = odc.torch.node_comm(
                mesh, self.key, timeout=600, device=device_index, cuda_sms=cuda_sms
            )
        return odc.torch.OdcFSDP(self.model, self.comm, self.optimizer)

    def _size_nvshmem_heap(self) -> None:
        """Under ODC_TRANSPORT=nvshmem: NVSHMEM's heap sized to what odc will hold for this model
        (odc.torch.size_nvshmem_heap: shards, accumulators, staging and node budgets, a margin),
        unless NVSHMEM_SYMMETRIC_SIZE or ODC_NVSHMEM_HEAP_GIB is set; rank 0 says which."""
        import odc.torch

        if not self.on_gpu or odc.comm.default_transport(self.local_rank) != "nvshmem":
            return
        ranks = self.mesh.get_group("shard").size() if self.mesh is not None else self.world_size
        sizing = odc.torch.size_nvshmem_heap(self.model, ranks)
        if self.rank == 0:
            print(f"odc.train: {sizing.describe()}", file=sys.stderr, flush=True)

    def _samples(self) -> list:
        from .data import load_token_ids, synthetic_tokens

        config, vocab_size = self.config, self.model.config.vocab_size
        if not config.token_ids_path:
            return synthetic_tokens(config.lengths, vocab_size, seed=config.seed)
        samples = load_token_ids(config.token_ids_path)
        largest = max(int(s.max()) for s in samples)
        if largest >= vocab_size:
            raise InvalidArgument(
                f"'{config.token_ids_path}' holds token id {largest}, beyond the "
                f"{config.preset} preset's vocabulary of {vocab_size}"
            )
        return samples

    # -- plan ----------------------------------------------------------------------------------
    def plan(self) -> None:
        """The cost model (given, or fitted on this model), the plan, the split groups."""
        import torch

        from .arms import adapt_plan, planner_policy
        from .data import schedule
        from .metrics import describe_cost

        config = self.config
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        self.probe.enter("setup")
        self.cost, self.calibration = config.cost, []
        if self.cost is None:
            label = f"[{config.comm} {config.policy}] cost fit, single and packed samples"
            self.cost, self.calibration = _calibrate(
                self.trainer, self.clock, config.max_tokens, self.model.config.vocab_size,
                self.world_size, config.seed, label if self.rank == 0 else None,
            )  # fmt: skip
            if self.rank == 0:
                print(
                    f"[{config.comm} {config.policy}] fitted cost: {describe_cost(self.cost)} "
                    "per microbatch",
                    file=sys.stderr,
                    flush=True,
                )
        planned = schedule(
            config.lengths,
            ranks=self.world_size,
            samples_per_minibatch=self.world_size * config.samples_per_rank,
            max_tokens=config.max_tokens,
            policy=planner_policy(config.policy),
            cost=self.cost,
            split=config.split,
            microbatch_memory=config.microbatch_memory,
        )
        # lb-mini-padded and fsdp2-unsharded pad with empty microbatches (arms.adapt_plan): the
        # plan that runs is the plan the prediction and the logs see.
        self.schedule = adapt_plan(planned, config.comm, config.policy)
        minibatches = self.schedule["minibatches"]
        self.num_steps = min(config.steps + config.warmup_steps, len(minibatches))
        self.splits = _split_groups(
            config, minibatches[: self.num_steps], self.model, self.engine, self.on_gpu
        )

    # -- steps ---------------------------------------------------------------------------------
    def run_steps(self) -> None:
        """Every planned minibatch, timed; with profile_dir, the last measured one once more
        under the profiler, after the measured ones (its timings are not kept: the profiler
        slows it)."""
        from .progress import Progress

        config = self.config
        self._compile_warm_up()
        # Everything built so far lives until the end: keep it out of the collector's scans, or
        # a full collection (timed by allocation counts, so at the same minibatch every run)
        # lands inside a measured minibatch.
        gc.collect()
        gc.freeze()
        progress = Progress(
            self.num_steps,
            f"[{config.comm} {config.policy}] minibatches ({config.warmup_steps} warm-up)",
            enabled=self.rank == 0,
        ).start()
        for step in range(self.num_steps):
            record, loss = self.step(step)
            self.records.append(record)
            self.losses.append(loss)
            self.grad_norms.append(float(self._grad_norm))  # after the span (a host wait)
            progress.update(f"{record.span:.3f} s, loss {loss:.4f}")
        progress.close()
        if config.profile_dir and self.num_steps > 0:
            import torch

            profiler = _start_profiler(torch, self.on_gpu)
            self.step(self.num_steps - 1)
            _write_profile(profiler, config, self.rank)

    def _planned_microbatch_tokens(self) -> List[int]:
        """Token counts of every microbatch the run's minibatches hold, on every rank."""
        return [
            sum(len(self.samples[i]) for i in microbatch)
            for minibatch in self.schedule["minibatches"][: self.num_steps]
            for rank in minibatch["ranks"]
            for microbatch in rank["microbatches"]
        ]

    def _compile_warm_up(self) -> None:
        """With compiled blocks: forward + backward over model.compile_warm_up_microbatches for
        the run's microbatch sizes, on every rank in step and untimed (its sums dropped, no
        optimizer step), so that torch compiles every variant the run needs here and not inside
        a measured minibatch (a recompile costs 5-40 s). Its progress line says how long it
        took."""
        from .model import compile_warm_up_microbatches
        from .progress import Progress

        planned = [n for n in self._planned_microbatch_tokens() if n > 0]
        if not self.compiled_blocks or not planned:
            return
        packed = compile_warm_up_microbatches(
            min(planned), max(planned), self.model.config.vocab_size, seed=self.config.seed + 2
        )
        label = f"[{self.config.comm} {self.config.policy}] compiling the blocks for every size"
        progress = Progress(len(packed), label, enabled=self.rank == 0).start()
        self.trainer.begin()
        for microbatch in packed:
            tokens = microbatch.num_tokens
            self.trainer.microbatch(microbatch, self.world_size * tokens)
            progress.update(f"{tokens} tokens in {len(microbatch.boundaries) - 1} document(s)")
        self.trainer.end()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self._compile_forward_only(packed)
        progress.close()

    def _compile_forward_only(self, packed: list) -> None:
        """The compile warm-up of a run's forward-only passes (GrpoRun: no_grad compiles a
        variant of its own), over the same packed microbatches."""

    def step(self, step: int):
        """One minibatch of the plan: its split chunks, this rank's microbatches, then
        minibatch_end, clipping, the optimizer step; returns (RankRecord, the summed loss)."""
        import torch
        import torch.distributed as dist

        minibatch = self.schedule["minibatches"][step]
        global_tokens = self._global_tokens(minibatch)
        if self.counter is not None:
            self.counter.take()  # count this minibatch's collectives only (not the cost fit's)
        self.clock.sync()
        dist.barrier()  # a common start: the span covers everything after it
        start_wall, start = time.perf_counter(), self.clock.mark()
        self._marks, self._details = [], []
        loss = torch.zeros((), device=self.device)
        prepare = time.perf_counter()
        self.splits.prepare(minibatch.get("splits", []))  # odc: this minibatch's K/V buffers
        prepare = time.perf_counter() - prepare
        self.probe.enter("minibatch_begin")
        self.trainer.begin()
        self.sync.begin()  # fsdp2-unsharded: every unit all-gathers here
        # With stealing, the work board opens before the split chunks: a member's queue is open
        # to thieves while it runs its chunk, as the prediction (odc.steal_minibatch) assumes.
        claims = None
        if self.config.steal:
            claims = self.engine.microbatches(
                minibatch, lengths=self.sample_lengths, cost=self.cost
            )
        # Split chunks first (docs/design.md, "Splitting outliers"): the members meet at the
        # start of the minibatch and no member waits for another's unrelated work.
        for split in minibatch.get("splits", []):
            loss += self._split_chunk(split, global_tokens)
        if claims is not None:
            # Which microbatches this rank runs is decided as it goes (the work board); ODC's
            # GradientSync does nothing per microbatch, so no "last" is needed.
            for claimed in claims:
                detail = {"queue": claimed.queue, "index": claimed.index}
                loss += self._microbatch(list(claimed), global_tokens, detail)
        else:
            microbatches = minibatch["ranks"][self.rank]["microbatches"]
            for index, microbatch in enumerate(microbatches):
                self.sync.before_microbatch(last=index == len(microbatches) - 1)
                loss += self._microbatch(microbatch, global_tokens)
        record = self._tail(start_wall)
        if self.counter is not None:
            record.collectives = self.counter.take()
        record.split_prepare = prepare
        for begin, end, tokens in self._marks:
            record.microbatches.append(
                (self.clock.seconds(start, begin), self.clock.seconds(start, end), tokens)
            )
            record.busy += self.clock.seconds(begin, end)
        record.details = self._details
        dist.all_reduce(loss)  # after the timed span
        return record, float(loss)

    def _global_tokens(self, minibatch: dict) -> int:
        """The loss normalization: the minibatch's predicted tokens on all ranks."""
        return sum(len(self.samples[i]) - 1 for i in minibatch["samples"])

    def _timed(self, packed, global_tokens: int, detail: dict, **microbatch_options):
        begin, host = self.clock.mark(), time.perf_counter()
        loss = self.trainer.microbatch(packed, global_tokens, **microbatch_options)
        detail["host_seconds"] = time.perf_counter() - host
        slowdown = self.config.rank_slowdown.get(self.rank, 1.0)
        if slowdown != 1.0:
            # A slower GPU, played: wait for this microbatch (the previous one was waited for
            # too, so the wait is its own time), then that time again x (factor - 1), before the
            # end mark: the microbatch's measured time is factor x its own.
            self.clock.sync()
            time.sleep((slowdown - 1.0) * (time.perf_counter() - host))
        self._marks.append((begin, self.clock.mark(), packed.num_tokens))
        self._details.append(detail)
        return loss

    def _split_chunk(self, split: dict, global_tokens: int):
        from .data import pack_chunk

        chunk = self.splits.chunk(split)
        if chunk is None:  # not a member
            return 0.0
        sample = self.samples[split["sample"]]
        packed = pack_chunk(sample, chunk.pieces)
        chunk.prefetch(self.device)  # its index tensors, before its clock starts (as packing)
        pieces = [list(p) for p in chunk.pieces]
        detail = {"split": {"length": len(sample), "pieces": pieces, "members": chunk.members}}
        return self._timed(packed, global_tokens, detail, split=chunk)

    def _microbatch(self, microbatch: list, global_tokens: int, detail: Optional[dict] = None):
        from .data import pack

        packed = pack([self.samples[i] for i in microbatch])
        self.probe.enter("microbatch", packed.num_tokens)
        detail = {**(detail or {}), "lengths": [len(self.samples[i]) for i in microbatch]}
        return self._timed(packed, global_tokens, detail)

    @property
    def sample_lengths(self) -> List[int]:
        """Every sample's tokens, by the plan's sample index (the work board prices with them)."""
        if self._sample_lengths is None:
            self._sample_lengths = [len(s) for s in self.samples]
        return self._sample_lengths

    def _tail(self, start_wall: float) -> RankRecord:
        """minibatch_end, clipping, the step, zero_grad and the GPU's end, each timed."""
        import torch

        self.probe.enter("end_and_step")
        tail = [time.perf_counter()]

        def clip():  # the norm stays on the device until the span is over
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

        for call in (
            self.trainer.end,
            clip,
            self.optimizer.step,
            self.optimizer.zero_grad,
            self.clock.sync,
        ):
            call()
            tail.append(time.perf_counter())
        record = RankRecord(busy=0.0, span=tail[-1] - start_wall)
        record.tail_phases = {
            name: tail[i + 1] - tail[i]
            for i, name in enumerate(("end", "clip", "step", "zero_grad", "sync"))
        }
        reduction = self.engine.replica_reduction if self.engine is not None else None
        if reduction is not None:
            record.replica_reduce = reduction.seconds
            record.replica_reduce_bytes = reduction.bytes_per_minibatch
        return record

    # -- collect -------------------------------------------------------------------------------
    def collect(self) -> Optional[dict]:
        """Every rank's records, peak memory and odc's flow-control counters to rank 0, which
        returns the run's summary (the others None)."""
        import torch.distributed as dist

        from .summary import summarize_run

        memory = self.probe.summary()
        peak = memory.get("torch_peak_bytes", 0)
        if self.engine is not None:
            memory.update({f"odc_{k}_bytes": v for k, v in self.engine.memory_bytes().items()})
            peak += self.engine.symmetric_bytes
        exchange_bytes = self.splits.peak_bytes
        self.splits.close()
        if exchange_bytes:  # the odc K/V exchange's symmetric buffers (not in torch's peak)
            memory["odc_kv_exchange_bytes"] = exchange_bytes
            peak += exchange_bytes
        # The streamed scheme's flow control (host transports): chunks sent, waits for credit.
        stream = self.comm.stream_stats() if self.engine is not None else None
        gathered = [None] * self.world_size
        records = [asdict(r) for r in self.records]
        dist.all_gather_object(gathered, (records, peak, memory, stream))
        if self.engine is not None:
            self.comm.close()
        if self.rank != 0:
            return None
        summary = summarize_run(
            self.config, self.schedule, gathered, self.losses, self.num_steps, self.world_size
        )
        summary["grad_norms"] = self.grad_norms  # the global norm: the same on every rank
        summary["compiled_blocks"] = self.compiled_blocks  # model.compile_blocks (--compile)
        summary["cost"] = list(self.cost)
        if self.config.cost is not None:
            summary["cost_source"] = "given"
        else:
            summary["cost_source"] = "fitted" if self.calibration else "tokens (too short to fit)"
        summary["calibration"] = self.calibration
        # The breakdown of the rank with the largest peak (docs/benchmarks-archive.md, memory).
        summary["memory"] = max((g for g in gathered), key=lambda g: g[1])[2]
        if self.engine is not None:
            summary["odc_stream_per_rank"] = [g[3] for g in gathered]
        return summary

    def close(self) -> None:
        """What this run froze becomes collectable again: under torchrun the next run of the
        same command lives in this process (a frozen model kept 1.44 GiB of the 1.5b preset's
        memory into the next run); a self-launched run leaves its process group."""
        import torch.distributed as dist

        gc.unfreeze()
        gc.collect()
        if not self.external_group and dist.is_initialized():
            dist.destroy_process_group()


def run_rank(rank: int, world_size: int, key: Optional[str], config: RunConfig) -> Optional[dict]:
    """One rank of one run (Run): the summary on rank 0, None elsewhere."""
    return drive(Run(rank, world_size, key, config))


def drive(run: Run) -> Optional[dict]:
    """A run's phases in order (its summary on rank 0); close() whatever happens."""
    try:
        run.setup()
        run.plan()
        run.run_steps()
        return run.collect()
    finally:
        run.close()


def _split_groups(config: RunConfig, minibatches, model, engine, on_gpu: bool):
    """The groups of the split samples of `minibatches` (odc.torch.split.SplitGroups), made on
    every rank before any timing: K/V through odc sub-communicators of the engine's comm
    ("odc"), or through torch.distributed subgroups ("nccl": NCCL on GPUs, gloo on the CPU).
    The odc buffers are held per minibatch (Run.step prepares its splits): a rank holds the
    buffers of the one group it is in, not of every group of the run."""
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
    # Every group made now, before any timing; each minibatch prepares its own groups' buffers.
    groups.connect([s for m in minibatches for s in m.get("splits", [])])
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


def default_store_path(directory: str) -> str:
    return os.path.join(directory, "store")
