"""odc.torch.lb_mini_step: LB-Mini from a DistributedSampler loop on 3 gloo ranks on the CPU,
against one process planning the whole step: the same plan, the same samples on each rank, every
sample exactly once, the samples themselves moved to the rank that runs them; and bad input
(2 ranks) raising the same error on every rank instead of leaving one waiting."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="odc.torch needs torch")

import odc  # noqa: E402

MAX_TOKENS = 64
COST = (1.0, 0.01, 2.0)


def _dataset_lengths():
    """Lengths of a 30-sample dataset: long-tailed, so the sampler's equal counts per rank are
    unequal work and LB-Mini moves samples."""
    generator = torch.Generator().manual_seed(7)
    short = torch.randint(2, 12, (30,), generator=generator)
    return [int(n) if i % 7 else 60 for i, n in enumerate(short.tolist())]


def _sample(index, length):
    """Dataset sample `index`: its tokens, recognizable after the move."""
    return torch.arange(length, dtype=torch.int64) + 1000 * index


def _rank(rank, world, key, store, steps):
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    import odc.torch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    lengths = _dataset_lengths()
    sampler = DistributedSampler(range(len(lengths)), world, rank, shuffle=True, seed=3)
    mine = list(sampler)  # this rank's dataset indices, in its order
    per_step = len(mine) // steps
    out = []
    for step in range(steps):
        indices = mine[step * per_step : (step + 1) * per_step]
        planned = odc.torch.lb_mini_step(
            [lengths[i] for i in indices], MAX_TOKENS, keys=indices, cost=COST
        )
        samples = planned.exchange([_sample(i, lengths[i]) for i in indices])
        received = [[s.tolist() for s in microbatch] for microbatch in samples]
        out.append((planned, planned.keys_of(planned.microbatches), received))
    dist.destroy_process_group()
    return out


def _launch(world, steps):
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        return odc.launch(_rank, world, store, steps, timeout=300)


def test_sampler_loop_equals_one_process_planning_the_step():
    world = 3
    steps = 2
    per_rank = _launch(world, steps)
    lengths = _dataset_lengths()
    for step in range(steps):
        steps_here = [results[step] for results in per_rank]
        first = steps_here[0][0]
        # One process with every rank's samples of the step, in global order (rank 0's first):
        # the planner's own plan of the whole step.
        alone = odc.plan(
            first.lengths, ranks=world, max_tokens=MAX_TOKENS, policy="lb-mini", cost=COST,
            samples_per_rank=None,
        )  # fmt: skip
        expected = [r["microbatches"] for r in alone["minibatches"][0]["ranks"]]
        for rank, (planned, keys, received) in enumerate(steps_here):
            assert planned.rank == rank and planned.num_ranks == world
            assert planned.plan == alone
            assert planned.microbatches_by_rank == expected
            assert planned.microbatches == expected[rank]
            assert (planned.lengths, planned.keys, planned.origins) == (
                first.lengths,
                first.keys,
                first.origins,
            )
            # The samples this rank got are those its microbatches name, whoever held them.
            assert received == [[_sample(k, lengths[k]).tolist() for k in m] for m in keys]
            for microbatch, costs in zip(planned.microbatches, planned.costs_by_rank[rank]):
                tokens = [planned.lengths[g] for g in microbatch]
                assert sum(tokens) <= MAX_TOKENS
                assert costs == pytest.approx(COST[2] + sum(n + 0.01 * n * n for n in tokens))
        # Every sample of the step exactly once, each the length the sampler's rank reported.
        ran = sorted(k for _, keys, _ in steps_here for m in keys for k in m)
        assert ran == sorted(first.keys)
        assert len(set(ran)) == len(ran) == world * (len(lengths) // world // steps)
        assert all(lengths[k] == n for k, n in zip(first.keys, first.lengths))
        # The sampler's equal counts were moved: some sample runs on another rank than its own.
        moved = [
            g
            for r, microbatches in enumerate(first.microbatches_by_rank)
            for m in microbatches
            for g in m
            if first.origins[g][0] != r
        ]
        assert moved, "the long-tailed step should move samples between ranks"


def _errors_rank(rank, world, key, store):
    import torch.distributed as dist

    import odc.torch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    messages = []
    # Options differing between ranks: every rank raises, naming both.
    try:
        odc.torch.lb_mini_step([5, 6], MAX_TOKENS if rank == 0 else 32)
    except odc.InvalidArgument as error:
        messages.append(str(error))
    # A wrong sample count on rank 1 only: rank 0 raises too, instead of waiting for its bytes.
    planned = odc.torch.lb_mini_step([5, 6, 7], MAX_TOKENS)
    samples = [torch.zeros(n) for n in (5, 6, 7)]
    try:
        planned.exchange(samples[:2] if rank == 1 else samples)
    except odc.InvalidArgument as error:
        messages.append(str(error))
    # The group is still usable: a correct exchange after the failed one.
    moved = planned.exchange(samples)
    messages.append(sum(len(m) for m in moved))
    dist.destroy_process_group()
    return messages


def test_bad_input_raises_the_same_way_on_every_rank():
    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_errors_rank, 2, os.path.join(directory, "store"), timeout=300)
    for rank, (options, count, samples_here) in enumerate(results):
        assert "pass the same values on every rank" in options
        if rank == 1:
            assert "rank 1 passed 2 samples to exchange but planned 3" in count
        else:
            assert "rank(s) [1] passed a wrong number of samples" in count
    assert sum(r[2] for r in results) == 6
