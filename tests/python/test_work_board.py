"""odc.Comm's work board on the host transport: every microbatch of random plans taken exactly
once across processes, with the counters adding up; the refusals (deterministic mode, outside a
minibatch, a bad plan) name what is wrong."""

import random

import pytest

import odc


def _plans(world_size, minibatches, seed):
    rng = random.Random(seed)
    plans = []
    for _ in range(minibatches):
        counts = [rng.randrange(0, 6) for _ in range(world_size)]
        costs = [[rng.uniform(0.0, 5.0) for _ in range(c)] for c in counts]
        plans.append((counts, costs))
    return plans


def _board_rank(rank, world_size, key, plans):
    taken = []
    with odc.Comm(rank, world_size, key, timeout=30) as comm:
        for counts, costs in plans:
            comm.minibatch_begin()
            comm.work_board_open(counts, costs)
            mine = []
            while (claim := comm.work_board_take()) is not None:
                mine.append(claim)
            stats = comm.work_board_stats()
            assert stats["own"] + stats["stolen"] == len(mine), (stats, mine)
            assert stats["own"] == sum(1 for queue, _ in mine if queue == rank)
            comm.minibatch_end()
            taken.append(mine)
        totals = comm.work_board_stats()
    return taken, totals


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_microbatch_taken_exactly_once(world_size):
    plans = _plans(world_size, 20, seed=world_size)
    results = odc.launch(_board_rank, world_size, plans, timeout=120)
    for m, (counts, _) in enumerate(plans):
        claims = sorted(claim for taken, _ in results for claim in taken[m])
        want = sorted(
            (queue, index) for queue, count in enumerate(counts) for index in range(count)
        )
        assert claims == want, f"minibatch {m}"
    all_taken = sum(len(mine) for taken, _ in results for mine in taken)
    assert sum(t["own_total"] + t["stolen_total"] for _, t in results) == all_taken


def _refusals_rank(rank, world_size, key):
    messages = {}
    with odc.Comm(rank, world_size, key, timeout=30, deterministic=True) as comm:
        comm.minibatch_begin()
        with pytest.raises(odc.InvalidUsage) as refused:
            comm.work_board_open([1] * world_size)
        messages["deterministic"] = str(refused.value)
        comm.minibatch_end()
    with odc.Comm(rank, world_size, key + "-b", timeout=30) as comm:
        with pytest.raises(odc.InvalidUsage) as refused:
            comm.work_board_open([1] * world_size)
        messages["outside"] = str(refused.value)
        comm.minibatch_begin()
        with pytest.raises(odc.InvalidUsage) as refused:
            comm.work_board_take()
        messages["before_open"] = str(refused.value)
        with pytest.raises(odc.InvalidArgument) as refused:
            comm.work_board_open([1] * (world_size + 1))
        messages["queues"] = str(refused.value)
        with pytest.raises(odc.InvalidArgument) as refused:
            comm.work_board_open([1] * world_size, [[-1.0]] * world_size)
        messages["cost"] = str(refused.value)
        comm.work_board_open([2] * world_size, [[1.0, 2.0]] * world_size)
        while comm.work_board_take() is not None:
            pass
        comm.minibatch_end()
    return messages


def test_refusals_name_the_problem():
    for messages in odc.launch(_refusals_rank, 2, timeout=120):
        assert "deterministic mode's fixed summation order cannot hold" in messages["deterministic"]
        assert "turn one of them off" in messages["deterministic"]
        assert "no minibatch is open" in messages["outside"]
        assert "not open" in messages["before_open"]
        assert "one count of microbatches per rank" in messages["queues"]
        assert "finite and >= 0" in messages["cost"]
