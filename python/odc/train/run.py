"""One rank of an `odc train` run: FSDP2 over a Qwen2 model, collective (plain FSDP2) or ODC,
microbatches from the planner, timed per microbatch and per minibatch.

Invariant: every rank runs the same minibatches in the same order; under `collective` every rank
also runs the same number of microbatches (LB-Micro pads with empty ones, which still join FSDP2's
collectives through a zero-weighted 1-token forward), under `odc` the counts may differ.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np


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
    cost: tuple = (1.69e-5, 9.75e-10, 0.069)  # design.md: Qwen2-1.5B shape on one H200, seconds
    seed: int = 0
    token_ids_path: Optional[str] = None  # JSONL token ids instead of synthetic ones


@dataclass
class RankRecord:
    """What one rank measured in one minibatch (seconds, relative to the minibatch start)."""

    busy: float
    span: float
    microbatches: List[tuple] = field(default_factory=list)  # (start, end, tokens)


def run_rank(rank: int, world_size: int, key: str, config: RunConfig) -> Optional[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc
    import odc.torch

    from .data import load_token_ids, pack, schedule, synthetic_tokens
    from .model import build_model, document_mask

    on_gpu = config.device == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"file://{config.store_path}",
        rank=rank,
        world_size=world_size,
        device_id=device if on_gpu else None,
    )
    try:
        with device:  # initialize on the device: a 7B model initialized on the CPU takes minutes
            model = build_model(config.preset, seed=config.seed)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if on_gpu else None,
            reduce_dtype=torch.float32 if on_gpu else None,
        )
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        engine = None
        if config.comm == "odc":
            comm = odc.Comm(rank, world_size, key, timeout=600, device=rank if on_gpu else None)
            engine = odc.torch.OdcFSDP(model, comm, optimizer)
        else:
            odc.torch.sum_gradients(model)  # the same sums as ODC (the loss is pre-scaled)

        vocab_size = model.config.vocab_size
        if config.token_ids_path:
            samples = load_token_ids(config.token_ids_path)
            largest = max(int(s.max()) for s in samples)
            if largest >= vocab_size:
                raise ValueError(
                    f"'{config.token_ids_path}' holds token id {largest}, beyond the "
                    f"{config.preset} preset's vocabulary of {vocab_size}"
                )
        else:
            samples = synthetic_tokens(config.lengths, vocab_size, seed=config.seed)
        plan = schedule(
            config.lengths,
            ranks=world_size,
            samples_per_minibatch=world_size * config.samples_per_rank,
            max_tokens=config.max_tokens,
            policy=config.policy,
            cost=config.cost,
        )
        num_steps = min(config.steps + config.warmup_steps, len(plan["minibatches"]))
        records, losses = [], []
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        for step in range(num_steps):
            minibatch = plan["minibatches"][step]
            global_tokens = sum(len(samples[i]) - 1 for i in minibatch["samples"])
            mine = minibatch["ranks"][rank]["microbatches"]
            sync()
            dist.barrier()  # a common start: the span covers everything after it
            start = time.perf_counter()
            record = RankRecord(busy=0.0, span=0.0)
            step_loss = torch.zeros((), device=device)
            if engine is not None:
                engine.minibatch_begin()
            for microbatch in mine:
                sync()
                begin = time.perf_counter()
                packed = pack([samples[i] for i in microbatch])
                ids = torch.from_numpy(packed.input_ids).view(1, -1).to(device)
                positions = torch.from_numpy(packed.position_ids).view(1, -1).to(device)
                labels = torch.from_numpy(packed.labels).to(device)
                mask = document_mask(torch.from_numpy(packed.document_ids).to(device))
                logits = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits
                loss_sum = torch.nn.functional.cross_entropy(
                    logits.view(-1, logits.shape[-1]).float(),
                    labels,
                    reduction="sum",
                    ignore_index=-100,
                )
                loss = odc.torch.scale_loss(loss_sum, global_tokens)
                loss.backward()  # an empty (padding) microbatch has no labels: loss 0
                step_loss += loss.detach()
                sync()
                end = time.perf_counter()
                record.busy += end - begin
                record.microbatches.append((begin - start, end - start, packed.num_tokens))
            if engine is not None:
                engine.minibatch_end()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            sync()
            record.span = time.perf_counter() - start
            dist.all_reduce(step_loss)  # after the timed span
            losses.append(float(step_loss))
            records.append(record)
            if rank == 0:
                print(
                    f"[{config.comm} {config.policy}] step {step + 1}/{num_steps} "
                    f"{record.span:.3f} s loss {losses[-1]:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
        peak = torch.cuda.max_memory_allocated() if on_gpu else 0
        if engine is not None:
            peak += engine.symmetric_bytes
        gathered = [None] * world_size
        dist.all_gather_object(gathered, ([asdict(r) for r in records], peak))
        if engine is not None:
            comm.close()
        if rank != 0:
            return None
        return _summary(config, plan, gathered, losses, num_steps, world_size)
    finally:
        dist.destroy_process_group()


def _summary(config, plan, gathered, losses, num_steps, world_size) -> dict:
    from .metrics import MinibatchTiming, summarize

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
    # The planner's prediction for the same minibatches, under this communication mode.
    mode = "odc" if config.comm == "odc" else "collective"
    predicted = [
        plan["minibatches"][s]["bubble"][mode] for s in range(config.warmup_steps, num_steps)
    ]
    last = num_steps - 1
    return {
        "preset": config.preset,
        "comm": config.comm,
        "policy": config.policy,
        "ranks": world_size,
        "device": config.device,
        "steps_measured": len(timings),
        "samples_per_rank": config.samples_per_rank,
        "max_tokens": config.max_tokens,
        **measured,
        "predicted_bubble": float(np.mean(predicted)) if predicted else 0.0,
        "peak_memory_bytes": max(gathered[r][1] for r in range(world_size)),
        "losses": losses,
        "timeline": [gathered[r][0][last]["microbatches"] for r in range(world_size)],
        "last_span_seconds": max(gathered[r][0][last]["span"] for r in range(world_size)),
    }


def default_store_path(directory: str) -> str:
    return os.path.join(directory, "store")
