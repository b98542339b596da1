"""The ODC protocol on GPUs (CUDA transport), one process per GPU: gather (also float32 shards
narrowed to bfloat16), uneven
scatter-accumulate with random delays (remote atomic adds and the deterministic pulled scheme),
sums read right after minibatch_end with no extra barrier, bitwise-identical deterministic sums
under different random delays, 1,000 minibatches, bf16 and fp32, faults, bad input."""

import os
import random
import time

import pytest

import odc


def _device_count():
    import torch

    return torch.cuda.device_count()


def _contribution(torch, minibatch, sender, call, size, device):
    index = torch.arange(size, device=device)
    return ((minibatch * 7 + sender * 3 + call * 5 + index) % 17).to(torch.float32)


def _pushes(minibatch, rank):
    return (minibatch + rank * 2) % 4


def _gather_rank(rank, world_size, key):
    import torch

    torch.cuda.set_device(rank)
    with odc.Comm(rank, world_size, key, timeout=30, device=rank) as comm:
        count = 100003  # odd: exercises the unaligned tail
        params = comm.alloc(count)
        params.tensor().copy_(rank * 1000 + torch.arange(count, device="cuda") % 1000)
        halves = comm.alloc(count, dtype="bfloat16")
        halves.tensor().fill_(rank + 1)
        comm.barrier()
        full = torch.empty(world_size * count, device="cuda")
        comm.gather(full, params)
        full_bf16 = torch.empty(world_size * count, device="cuda", dtype=torch.bfloat16)
        comm.gather(full_bf16, halves)
        # float32 shards narrowed to bfloat16 while pulled: as Tensor.to rounds (values that need
        # rounding; odd count, and a destination offset by one element so the vector path's
        # alignment differs from the shards').
        wide = comm.alloc(count)
        generator = torch.Generator(device="cuda").manual_seed(rank)
        wide.tensor().copy_(torch.randn(count, device="cuda", generator=generator) * 1e3)
        comm.barrier()
        narrowed = torch.empty(world_size * count + 1, device="cuda", dtype=torch.bfloat16)
        comm.gather(narrowed[1:], wide)
        shards = torch.empty(world_size * count, device="cuda")
        comm.gather(shards, wide)
        torch.cuda.synchronize()
        for r in range(world_size):
            expected = r * 1000 + torch.arange(count, device="cuda") % 1000
            assert torch.equal(full[r * count : (r + 1) * count], expected.float())
            assert torch.all(full_bf16[r * count : (r + 1) * count] == r + 1)
        assert torch.equal(
            narrowed[1:].view(torch.int16), shards.to(torch.bfloat16).view(torch.int16)
        )
        comm.barrier()
        torch.cuda.synchronize()
    return True


def _minibatch_rank(
    rank,
    world_size,
    key,
    num_minibatches,
    count,
    src_dtype,
    delays,
    deterministic=False,
    barrier_after=True,
):
    import torch

    gpu = rank % torch.cuda.device_count()  # ranks may share a GPU (dev/gpu scripts)
    torch.cuda.set_device(gpu)
    rng = random.Random(rank)
    dtype = torch.float32 if src_dtype == "float32" else torch.bfloat16
    with odc.Comm(
        rank, world_size, key, timeout=60, device=gpu, deterministic=deterministic
    ) as comm:
        accumulator = comm.alloc(count, accumulator=True)
        everything = torch.empty(world_size * count, device="cuda")
        for minibatch in range(num_minibatches):
            comm.minibatch_begin()
            for call in range(_pushes(minibatch, rank)):
                if delays:
                    time.sleep(rng.uniform(0, 0.002))  # host-side skew
                    torch.cuda._sleep(rng.randint(0, 200_000))  # device-side skew
                src = _contribution(torch, minibatch, rank, call, world_size * count, "cuda")
                comm.scatter_accumulate(src.to(dtype), accumulator)
            comm.minibatch_end()
            comm.gather(everything, accumulator)
            expected = torch.zeros(world_size * count, device="cuda")
            for sender in range(world_size):
                for call in range(_pushes(minibatch, sender)):
                    expected += _contribution(
                        torch, minibatch, sender, call, world_size * count, "cuda"
                    )
            if not torch.equal(everything, expected):
                bad = (everything != expected).nonzero()[0].item()
                raise AssertionError(
                    f"minibatch {minibatch} element {bad}: {everything[bad]} != {expected[bad]}"
                )
            if barrier_after:
                comm.barrier()
        torch.cuda.synchronize()
    return num_minibatches


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_equals_concatenated_shards(world_size):
    if _device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    assert odc.launch(_gather_rank, world_size, timeout=300) == [True] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_scatter_accumulate_uneven_with_delays(world_size, src_dtype):
    if _device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = odc.launch(_minibatch_rank, world_size, 6, 65537, src_dtype, True, timeout=300)
    assert results == [6] * world_size


@pytest.mark.parametrize("deterministic", [False, True])
def test_sums_valid_after_minibatch_end_without_barrier(deterministic):
    # Every rank gathers every owner's sums right after minibatch_end, with no barrier before the
    # next minibatch_begin: a faster peer must not reset what a slower one still reads.
    world_size = min(4, _device_count())
    results = odc.launch(
        _minibatch_rank, world_size, 40, 4099, "bfloat16", True, deterministic, False, timeout=300
    )
    assert results == [40] * world_size


def _deterministic_rank(rank, world_size, key, delay_seed, count):
    import torch

    gpu = rank % torch.cuda.device_count()  # ranks may share a GPU (dev/gpu scripts)
    torch.cuda.set_device(gpu)
    delays = random.Random(delay_seed * 100 + rank)
    data = torch.Generator(device="cuda").manual_seed(1000 + rank)  # the same data in every run
    with odc.Comm(rank, world_size, key, timeout=60, device=gpu, deterministic=True) as comm:
        accumulator = comm.alloc(count, accumulator=True)
        everything = torch.empty(world_size * count, device="cuda")
        runs = []
        for minibatch in range(4):
            comm.minibatch_begin()
            for _ in range(1 + (rank + minibatch) % 3):
                time.sleep(delays.uniform(0, 0.003))  # host-side skew
                torch.cuda._sleep(delays.randint(0, 400_000))  # device-side skew
                src = torch.randn(world_size * count, device="cuda", generator=data) * 1e3
                comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            comm.gather(everything, accumulator)
            runs.append(everything.view(torch.int32).cpu().clone())
        torch.cuda.synchronize()
    return [r.numpy().tobytes() for r in runs]


def test_deterministic_sums_bitwise_identical_under_random_delays():
    # Non-integer fp32 contributions (their sum depends on the order of addition), pushed with
    # different random host and device delays in each run: every bit of every sum is the same.
    world_size = min(4, _device_count())
    first = odc.launch(_deterministic_rank, world_size, 1, 65537, timeout=300)
    second = odc.launch(_deterministic_rank, world_size, 2, 65537, timeout=300)
    assert first == second
    assert all(len(minibatches) == 4 for minibatches in first)


def test_thousand_minibatches_lose_nothing():
    world_size = min(4, _device_count())
    results = odc.launch(_minibatch_rank, world_size, 1000, 1024, "float32", False, timeout=600)
    assert results == [1000] * world_size


def _silent_rank(rank, world_size, key):
    import torch

    torch.cuda.set_device(rank)
    with odc.Comm(rank, world_size, key, timeout=2.0, device=rank) as comm:
        if rank == 1:
            time.sleep(6.0)  # alive, never arrives at the barrier
            return None
        comm.barrier()  # enqueued: returns at once
        torch.cuda.synchronize()  # the device wait expires after the timeout: no hang
        try:
            comm.barrier()
        except odc.Error as error:
            return error.code, str(error)
    return None


def test_silent_rank_reports_timeout_instead_of_hanging():
    code, message = odc.launch(_silent_rank, 2, timeout=120)[0]
    assert code == odc._capi.TIMEOUT
    assert "rank 0: barrier: device barrier timed out" in message
    assert "rank 0 waited for rank 1" in message


def _bad_input_rank(rank, world_size, key):
    import numpy as np
    import torch

    torch.cuda.set_device(rank)
    errors = {}
    with odc.Comm(rank, world_size, key, timeout=30, device=rank) as comm:
        accumulator = comm.alloc(16, accumulator=True)
        comm.minibatch_begin()
        for name, src in {
            "host numpy": np.ones(world_size * 16, np.float32),
            "wrong size": torch.ones(world_size * 16 + 1, device="cuda"),
            "float64": torch.ones(world_size * 16, device="cuda", dtype=torch.float64),
            "cpu tensor": torch.ones(world_size * 16),
        }.items():
            try:
                comm.scatter_accumulate(src, accumulator)
                errors[name] = None
            except odc.Error as error:
                errors[name] = error.code
        comm.scatter_accumulate(torch.ones(world_size * 16, device="cuda"), accumulator)
        comm.minibatch_end()
        torch.cuda.synchronize()
        assert torch.all(accumulator.tensor() == world_size)
        comm.barrier()
        torch.cuda.synchronize()
    return errors


def test_bad_input_is_refused_and_changes_nothing():
    for errors in odc.launch(_bad_input_rank, 2, timeout=120):
        assert errors == {
            "host numpy": odc._capi.INVALID_ARGUMENT,
            "wrong size": odc._capi.INVALID_ARGUMENT,
            "float64": odc._capi.INVALID_ARGUMENT,
            "cpu tensor": odc._capi.INVALID_ARGUMENT,
        }


def test_no_such_device():
    with pytest.raises(odc.Error) as raised:
        odc.Comm(0, 1, f"nodev-{os.getpid()}", device=99)
    assert "CUDA device 99 does not exist" in str(raised.value)


def test_sm_budget_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv("ODC_CUDA_SMS", "many")
    with pytest.raises(odc.Error) as raised:
        odc.Comm(0, 1, f"sms-{os.getpid()}", device=0)
    assert "ODC_CUDA_SMS='many': expected a positive integer" in str(raised.value)


@pytest.mark.parametrize("budget", ["1", "32", "100000"])
def test_gather_and_pushes_under_any_sm_budget(monkeypatch, budget):
    # ODC_CUDA_SMS only sizes grids: one SM, a training budget and "more than the device has"
    # (= all) give the same bytes and sums (the ranks inherit the variable).
    monkeypatch.setenv("ODC_CUDA_SMS", budget)
    assert odc.launch(_gather_rank, 2, timeout=300) == [True, True]
    assert odc.launch(_minibatch_rank, 2, 4, 65537, "float32", True, timeout=300) == [4, 4]


def _aborting_rank(rank, world_size, key):
    """Rank 1 aborts (an exception inside its minibatch) while rank 0 waits for it in a device
    barrier with a long timeout: rank 0's wait must end at once, naming rank 1 and its reason."""
    import torch

    gpu = rank % torch.cuda.device_count()  # ranks may share a GPU (dev/gpu scripts)
    torch.cuda.set_device(gpu)
    with odc.Comm(rank, world_size, key, timeout=120.0, device=gpu) as comm:
        accumulator = comm.alloc(1024, accumulator=True)
        comm.minibatch_begin()
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(1.0)  # rank 0 is in its device barrier by now
            comm.abort("ValueError inside a minibatch: boom")
            time.sleep(10.0)  # alive (a dead rank is another test), silent
            return None
        comm.scatter_accumulate(torch.ones(world_size * 1024, device="cuda"), accumulator)
        comm.minibatch_end()
        torch.cuda.synchronize()
        try:
            comm.poll_error()
        except odc.Error as error:
            return error.code, str(error)
    return "no error"


def test_aborting_rank_ends_peers_device_waits_at_once():
    results = odc.launch(_aborting_rank, 2, timeout=300)
    code, message = results[0]
    assert code == odc._capi.REMOTE_ERROR, message
    assert "rank 1 failed" in message and "boom" in message, message
    assert "timed out" not in message, message  # not the 120 s timeout


def _dies_rank(rank, world_size, key):
    import signal

    import torch

    torch.cuda.set_device(rank)
    with odc.Comm(rank, world_size, key, timeout=2.0, device=rank) as comm:
        accumulator = comm.alloc(1024, accumulator=True)
        comm.minibatch_begin()
        torch.cuda.synchronize()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-minibatch, before pushing
        comm.scatter_accumulate(torch.ones(world_size * 1024, device="cuda"), accumulator)
        comm.minibatch_end()
        torch.cuda.synchronize()  # the device wait gives up after the timeout: no hang
        try:
            comm.barrier()
        except odc.Error as error:
            return error.code, str(error)
    return None


def test_dead_rank_reports_timeout_naming_it():
    with pytest.raises(odc.LaunchError) as raised:
        odc.launch(_dies_rank, 2, timeout=120)
    assert "exited with code -9" in raised.value.failures[1]
    code, message = raised.value.results[0]
    assert code == odc._capi.TIMEOUT
    assert "rank 0 waited for rank 1" in message


def _cupy_rank(rank, world_size, key):
    import cupy

    with cupy.cuda.Device(rank):
        with odc.Comm(rank, world_size, key, timeout=30, device=rank) as comm:
            params = comm.alloc(4096)
            shard = cupy.asarray(params)  # a view through __cuda_array_interface__, no copy
            shard[:] = rank + 1
            comm.barrier()
            full = cupy.empty(world_size * 4096, dtype=cupy.float32)
            comm.gather(full, params)
            cupy.cuda.Device(rank).synchronize()
            expected = cupy.repeat(cupy.arange(1, world_size + 1, dtype=cupy.float32), 4096)
            assert bool(cupy.all(full == expected))
            assert shard.data.ptr == params.__cuda_array_interface__["data"][0]
            comm.barrier()
            cupy.cuda.Device(rank).synchronize()
    return True


def test_cupy_arrays_without_copies():
    pytest.importorskip("cupy")
    assert odc.launch(_cupy_rank, 2, timeout=120) == [True, True]
