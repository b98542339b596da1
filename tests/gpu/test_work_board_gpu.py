"""The work board on the device transports, several ranks on one GPU (dev/gpu/run.sh's gpu-suite
stages run it): claims are compare-and-swaps on device memory (CUDA: atomicCAS_system on the
peer mappings; NVSHMEM: its device-side atomics), each microbatch of random plans is taken exactly
once, and a take never waits for the caller's stream: it returns while a long kernel enqueued
before it is still running."""

import os
import random
from pathlib import Path

import pytest

import odc

pytestmark = pytest.mark.one_gpu


def _nvshmem_plugin():
    given = os.environ.get("ODC_NVSHMEM_PLUGIN")
    if given:
        return Path(given)
    return Path(odc._capi.lib._name).resolve().parent / "libodc_nvshmem.so"


@pytest.fixture(params=["cuda", "nvshmem-api", "nvshmem-direct"])
def transport(request, monkeypatch):
    if request.param == "cuda":
        monkeypatch.setenv("ODC_TRANSPORT", "cuda")
        return "cuda"
    if not _nvshmem_plugin().is_file():
        pytest.skip(f"no NVSHMEM plugin at {_nvshmem_plugin()}")
    # odc.launch spawns the ranks, which inherit this environment.
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "0" if request.param == "nvshmem-api" else "1")
    monkeypatch.delenv("ODC_LOCAL_WORLD_SIZE", raising=False)
    return "nvshmem"


def _plans(world_size, minibatches, seed):
    rng = random.Random(seed)
    plans = []
    for _ in range(minibatches):
        counts = [rng.randrange(0, 7) for _ in range(world_size)]
        plans.append((counts, [[rng.uniform(0.5, 4.0) for _ in range(c)] for c in counts]))
    return plans


def _board_rank(rank, world_size, key, plans, transport):
    import torch

    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    taken = []
    stream_busy_during_take = []
    with odc.Comm(rank, world_size, key, timeout=60, device=device) as comm:
        assert comm.over_nvshmem == (transport == "nvshmem")
        for m, (counts, costs) in enumerate(plans):
            comm.minibatch_begin()
            comm.work_board_open(counts, costs)
            mine = []
            while True:
                if m % 5 == 0:
                    # "Computing" the last microbatch: a long kernel on the caller's stream. The
                    # claim must not wait for it (it runs on a private stream).
                    torch.cuda._sleep(200_000_000)
                claim = comm.work_board_take()
                if m % 5 == 0:
                    stream_busy_during_take.append(not torch.cuda.current_stream().query())
                if claim is None:
                    break
                mine.append(claim)
            comm.minibatch_end()
            taken.append(mine)
        torch.cuda.synchronize()
        stats = comm.work_board_stats()
    return taken, stats, stream_busy_during_take


@pytest.mark.parametrize("world_size", [2, 4])
def test_device_board_takes_each_microbatch_once(transport, world_size):
    plans = _plans(world_size, 20, seed=world_size)
    results = odc.launch(_board_rank, world_size, plans, transport, timeout=300)
    for m, (counts, _) in enumerate(plans):
        claims = sorted(claim for taken, _, _ in results for claim in taken[m])
        want = sorted(
            (queue, index) for queue, count in enumerate(counts) for index in range(count)
        )
        assert claims == want, f"minibatch {m}"
    total = sum(len(mine) for taken, _, _ in results for mine in taken)
    assert sum(s["own_total"] + s["stolen_total"] for _, s, _ in results) == total
    # Some take returned while its rank's stream still ran the kernel enqueued before it (a take
    # that synchronized the caller's stream or the device would always find it idle).
    assert any(busy for _, _, flags in results for busy in flags), results


def _first_open_behind_queued_work(rank, world_size, key, counts):
    import torch

    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    with odc.Comm(rank, world_size, key, timeout=60, device=device) as comm:
        # Work still queued on the caller's (legacy default) stream when the first open allocates
        # the claim words: their zeroing must not land after the open (the claims run on a
        # private non-blocking stream, which nothing orders after the allocation's memset).
        torch.cuda._sleep(2_000_000_000)
        comm.minibatch_begin()
        comm.work_board_open(counts, None)
        mine = [comm.work_board_take()]
        torch.cuda.synchronize()
        while mine[-1] is not None:
            mine.append(comm.work_board_take())
        comm.minibatch_end()
        torch.cuda.synchronize()
    return [claim for claim in mine if claim is not None]


def test_device_board_first_open_behind_queued_work(transport):
    if transport != "cuda":
        pytest.skip("NVSHMEM's allocation synchronizes the device after zeroing")
    counts = [4, 4]
    results = odc.launch(_first_open_behind_queued_work, 2, counts, timeout=300)
    claims = sorted(claim for taken in results for claim in taken)
    assert claims == [(q, i) for q in range(2) for i in range(4)], results
