"""The summary of one `odc train` run, made on rank 0 from every rank's records (Run.collect):
what ran, what was measured, what the planner predicted for the same minibatches, and logs
enough to re-plan, re-simulate or re-fit what ran. A pure function of its inputs."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

TAIL_PHASES = ("end", "clip", "step", "zero_grad", "sync")  # RankRecord.tail_phases


def summarize_run(config, plan, gathered, losses, num_steps, world_size) -> dict:
    """gathered[r] = (rank r's records as dicts, its peak bytes, its memory breakdown, its
    stream stats); steps config.warmup_steps..num_steps-1 are the measured ones."""
    measured = range(config.warmup_steps, num_steps)
    last = num_steps - 1
    return {
        **_what_ran(config, plan, measured, world_size),
        **_measured_and_predicted(config, plan, gathered, measured, world_size),
        **_per_minibatch_logs(config, plan, gathered, measured, world_size),
        "peak_memory_bytes": max(gathered[r][1] for r in range(world_size)),
        "losses": losses,
        "timeline": [gathered[r][0][last]["microbatches"] for r in range(world_size)],
        **_hybrid_summary(config, gathered, num_steps, world_size),
        "last_span_seconds": max(gathered[r][0][last]["span"] for r in range(world_size)),
        **_edges(config, gathered, num_steps, world_size),
        **_stealing(config, gathered, measured, world_size),
    }


def _stealing(config, gathered, measured, world_size) -> dict:
    """Work stealing: the measured minibatches' microbatches and how many of them a rank other
    than the planned one ran (the work board's claims, run.py)."""
    if not getattr(config, "steal", False):
        return {"steal": False}
    run = moved = 0
    for rank in range(world_size):
        for step in measured:
            for detail in gathered[rank][0][step]["details"]:
                if "queue" in detail:
                    run += 1
                    moved += detail["queue"] != rank
    return {"steal": True, "microbatches_run": run, "microbatches_moved": moved}


def _cuda_sms(config) -> Optional[str]:
    """The SM budget odc's kernels ran with, as text: the user's ODC_CUDA_SMS, else odc.train's."""
    from .run import training_cuda_sms

    given = training_cuda_sms(config)
    return os.environ.get("ODC_CUDA_SMS") or (None if given is None else str(given))


def _what_ran(config, plan, measured, world_size) -> dict:
    return {
        "preset": config.preset,
        "comm": config.comm,
        "policy": config.policy,
        "split": config.split,
        "kv_exchange": config.kv_exchange if config.split == "auto" else None,
        "split_samples": sum(len(plan["minibatches"][s].get("splits", [])) for s in measured),
        "ranks": world_size,
        "device": config.device,
        "steps_measured": len(measured),
        "samples_per_rank": config.samples_per_rank,
        "max_tokens": config.max_tokens,
        "microbatch_memory": config.microbatch_memory,
        "optimizer": config.optimizer,
        # With checkpointing a forward is 1/4 of forward + backward, else 1/3 (the forward-only
        # phases' cost; odc simulate's --forward-fraction).
        "activation_checkpointing": config.activation_checkpointing,
        "odc_cuda_sms": _cuda_sms(config) if config.comm == "odc" else None,
        # Under collective a rank's busy time includes its waits inside FSDP2's per-layer
        # collectives, so its measured bubble is near zero by construction, not a measurement of
        # idle time: compare step time (span) there instead.
        # The FSDP2 arms wait inside collectives that run within microbatches (fsdp2-unsharded:
        # the last backward's reduce-scatters, where a rank that finished early waits for the
        # rest), so the same holds there.
        "bubble_measured": config.comm == "odc",
        "warmup_steps": config.warmup_steps,
    }


def _measured_and_predicted(config, plan, gathered, measured, world_size) -> dict:
    """Throughput, spans and bubble as measured, and the planner's prediction for the same
    minibatches under this communication mode, on the measurement's basis: time-weighted over
    minibatches, span against span (metrics.py)."""
    from .metrics import MinibatchTiming, compare_prediction, predict_minibatch, summarize

    timings = []
    for step in measured:
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
    from .arms import prediction_mode

    mode = prediction_mode(config.comm, getattr(config, "steal", False))
    cost = tuple(plan["cost"][k] for k in ("a", "b", "c")) + (plan["cost"].get("floor", 0.0),)
    predicted = [
        predict_minibatch(
            plan["minibatches"][s]["ranks"],
            config.lengths,
            cost,
            mode,
            plan["minibatches"][s].get("splits", []),
        )
        for s in measured
    ]
    return {
        **summarize(timings),
        **compare_prediction(timings, predicted),
        # Each measured minibatch's span (slowest rank): the spread the table reports.
        "minibatch_seconds": [t.span_seconds for t in timings],
    }


def _per_minibatch_logs(config, plan, gathered, measured, world_size) -> dict:
    ranks = range(world_size)
    return {
        # The measured minibatches' sample lengths, in plan order: with the cost model, enough
        # to re-plan and re-simulate exactly these minibatches (dev/analysis/validate_runs.py).
        "measured_lengths": [
            config.lengths[i] for s in measured for i in plan["minibatches"][s]["samples"]
        ],
        # Per measured minibatch, the longest host time of each call after the last microbatch
        # over the ranks (RankRecord.tail_phases).
        "tail_phase_seconds": [
            {
                name: max(gathered[r][0][s]["tail_phases"].get(name, 0.0) for r in ranks)
                for name in TAIL_PHASES
            }
            for s in measured
        ],
        # Per measured minibatch, the longest host time over the ranks of preparing its split
        # groups' K/V buffers (odc.torch.split, inside the span; 0 without splits).
        "split_prepare_seconds": [
            max(gathered[r][0][s].get("split_prepare", 0.0) for r in ranks) for s in measured
        ],
        # FSDP2 arms: per measured minibatch and rank, the all-gathers and reduce-scatters it
        # issued ({"all_gather", "reduce_scatter"}, one per FSDP2 unit each time; None under odc):
        # what the arm did, e.g. fsdp2-deferred's one reduce-scatter per unit per minibatch.
        "fsdp2_collectives": [
            [gathered[r][0][s].get("collectives") or None for r in ranks] for s in measured
        ],
        # Every measured microbatch: [minibatch][rank] -> [{"start", "end", "tokens",
        # "host_seconds", "lengths" or "split"}] (RankRecord.details), enough to fit a cost
        # model to what ran (dev/analysis/microbatch_fit.py) or to find host-bound microbatches.
        "microbatch_log": [
            [
                [
                    {"start": m[0], "end": m[1], "tokens": m[2], **d}
                    for m, d in zip(gathered[r][0][s]["microbatches"], gathered[r][0][s]["details"])
                ]
                for r in ranks
            ]
            for s in measured
        ],
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
