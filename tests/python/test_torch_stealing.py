"""Work stealing through odc.torch (OdcFSDP.microbatches) on the CPU: every planned microbatch runs
exactly once whoever claims it, the trained model is the single-process reference's, a slowed
rank's tail moves to the others, and the misuses are refused with one line."""

import os
import tempfile
import time

import numpy as np
import pytest
import torch

import odc
from tiny_lm import (
    LR,
    MAX_NORM,
    STEPS,
    full_parameters,
    loss_sum,
    make_model,
    max_diff,
    minibatch_samples,
    plans,
    reference_state,
    shard_blocks,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _steal_rank(
    rank, world_size, key, store_path, schedule, slow_rank, sleep_seconds, device="cpu"
):
    """Trains STEPS minibatches with engine.microbatches(plan); rank `slow_rank` sleeps before
    each of its microbatches. Returns (claims per step as (queue, index, samples), final full
    state, steal stats). device "cuda": every rank on GPU rank % count (dev/gpu/run.sh
    steal-check; ranks may share one, FSDP2's few collectives through gloo)."""
    import torch.distributed as dist

    import odc.torch
    from test_torch_fsdp2_frozen import _join

    gpu = _join(rank, world_size, store_path, device)
    where = "cpu" if gpu is None else f"cuda:{gpu}"
    try:
        torch.manual_seed(0)
        model = shard_blocks(make_model().to(where))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        comm = odc.Comm(rank, world_size, key, timeout=60, device=gpu)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)
        claims = []
        for step in range(STEPS):
            samples = [t.to(where) for t in minibatch_samples(step)]
            tokens = sum(int(t.shape[1]) - 1 for t in samples)
            lengths = [int(t.shape[1]) for t in samples]
            mine = []
            with engine.minibatch():
                for microbatch in engine.microbatches(schedule[step], lengths=lengths):
                    if rank == slow_rank:
                        time.sleep(sleep_seconds)
                    mine.append((microbatch.queue, microbatch.index, list(microbatch)))
                    picked = [samples[i] for i in microbatch]
                    odc.torch.scale_loss(loss_sum(model, picked), tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            claims.append(mine)
        stats = engine.steal_stats()
        state = {k: v.float().numpy() for k, v in full_parameters(model).items()}
        comm.close()
        return claims, state, stats
    finally:
        dist.destroy_process_group()


def _launch(function, world_size, *args):
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        return odc.launch(function, world_size, store, *args, timeout=300)


def test_every_planned_microbatch_runs_once_and_the_model_matches_the_reference():
    world = 3
    schedule = plans(world, "lb-mini")
    results = _launch(_steal_rank, world, schedule, 0, 0.3)
    for step in range(STEPS):
        ran = [(q, i) for claims, _, _ in results for q, i, _ in claims[step]]
        planned = [(q, i) for q in range(world) for i in range(len(schedule[step][q]))]
        assert sorted(ran) == sorted(planned), f"step {step}: ran {ran}, planned {planned}"
        for claims, _, _ in results:  # the samples yielded are the plan's
            for q, i, samples in claims[step]:
                assert samples == schedule[step][q][i]
    states = [state for _, state, _ in results]
    assert max_diff(states[0], reference_state()) < 1e-5
    assert all(max_diff(states[0], s) == 0.0 for s in states[1:])  # one model, every rank
    # Rank 0 sleeps 0.3 s before each microbatch it runs: the others run out of their own
    # microbatches first and take its tail, in some minibatch (its counts are 2 or more).
    stolen_from_0 = sum(
        1 for r, (claims, _, _) in enumerate(results) for step in claims for q, _, _ in step
        if q == 0 and r != 0
    )  # fmt: skip
    assert any(len(schedule[s][0]) > 1 for s in range(STEPS))
    assert stolen_from_0 > 0
    total_stolen = sum(stats["stolen_total"] for _, _, stats in results)
    total_own = sum(stats["own_total"] for _, _, stats in results)
    assert total_stolen == sum(
        1 for r, (claims, _, _) in enumerate(results) for step in claims for q, _, _ in step
        if q != r
    )  # fmt: skip
    assert total_own + total_stolen == sum(len(q) for step in schedule for q in step)


def _misuse_rank(rank, world_size, key, store_path):
    import torch.distributed as dist

    import odc.torch

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    messages = []
    try:
        model = shard_blocks(make_model())
        comm = odc.Comm(rank, world_size, key, timeout=60)
        engine = odc.torch.OdcFSDP(model, comm)
        plan = [[[0]], [[1]]]
        try:  # outside a minibatch
            next(iter(engine.microbatches(plan)))
        except odc.InvalidUsage as error:
            messages.append(str(error))
        with engine.minibatch():
            try:  # one rank's plan for a 2-rank communicator
                next(iter(engine.microbatches([[[0]]])))
            except odc.InvalidArgument as error:
                messages.append(str(error))
            own = list(engine.microbatches(plan, steal=False))
        messages.append(str([list(m) for m in own]))
        deterministic = odc.Comm(rank, world_size, key + "d", timeout=60, deterministic=True)
        engine.reset(deterministic)
        comm.close()
        with engine.minibatch():
            try:
                next(iter(engine.microbatches(plan)))
            except odc.InvalidUsage as error:
                messages.append(str(error))
        deterministic.close()
        return messages
    finally:
        dist.destroy_process_group()


def test_misuse_is_refused_naming_the_fix():
    results = _launch(_misuse_rank, 2)
    for rank, messages in enumerate(results):
        assert len(messages) == 4, messages
        assert "outside a minibatch" in messages[0]
        assert "1 ranks' microbatches for a communicator of 2 ranks" in messages[1]
        assert messages[2] == str([[rank]])
        assert "deterministic" in messages[3]


def test_plan_costs_from_lengths_and_the_cost_model():
    from odc.torch.stealing import plan_costs, plan_queues

    queues = plan_queues({"ranks": [{"microbatches": [[0, 1], [2]]}, {"microbatches": []}]}, 2)
    assert queues == [[[0, 1], [2]], []]
    assert plan_costs(queues, None, [10, 20, 30], (1.0, 0.01, 5.0)) == [
        [5.0 + 10 + 1 + 20 + 4, 5.0 + 30 + 9],
        [],
    ]
    assert plan_costs(queues, None, [10, 20, 30], (1.0, 0.0, 0.0, 40.0)) == [[40.0, 40.0], []]
    assert plan_costs(queues, None, None, (1.0, 0.0, 0.0)) == [[1.0, 1.0], []]
    with pytest.raises(odc.InvalidArgument, match="one predicted cost per planned microbatch"):
        plan_costs(queues, [[1.0], []], None, (1.0, 0.0, 0.0))
    with pytest.raises(odc.InvalidArgument, match="finite number >= 0"):
        plan_costs(queues, [[1.0, float("nan")], []], None, (1.0, 0.0, 0.0))
    with pytest.raises(odc.InvalidArgument, match="every sample's length"):
        plan_costs(queues, None, [10], (1.0, 0.0, 0.0))
    assert np.isclose(sum(map(sum, plan_costs(queues, None, [1, 2, 3], (2, 0, 0)))), 12.0)
