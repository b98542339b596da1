"""Hardening on GPUs (CUDA transport, one process per GPU):
- destroying a communicator right after enqueuing a gather (behind a long device sleep, so it
  has not run yet) neither crashes the device nor corrupts the result: destroy completes this
  rank's queued work and meets its peers before it frees (or closes) any memory;
- after a device-side timeout in minibatch_end, odc.torch refuses the optimizer step (no
  partial sum reaches it) and the parameters stay as they were;
- barrier() on one rank paired with minibatch_begin() on another fails on both with
  "collective mismatch" naming both operations, as the host transport does (over NVSHMEM too:
  test_nvshmem_comm.py).
Every wait is bounded (timeouts of a few seconds): a regression fails, it never hangs."""

import gc
import os
import pathlib
import sys
import tempfile
import time

import pytest

import odc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))


def _mismatch_rank(rank, world_size, key):
    import torch

    # Ranks share the GPUs there are (one GPU: both on it; dev/gpu/run.sh's deterministic stage).
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    with odc.Comm(rank, world_size, key, timeout=10, device=device) as comm:
        comm.barrier()  # both in the same collective: passes
        if rank == 0:
            comm.barrier()
        else:
            comm.minibatch_begin()
        torch.cuda.synchronize()  # the device barrier ends at once, with the mismatch recorded
        try:
            comm.barrier()  # the next call reports it
        except odc.Error as error:
            return error.code, str(error)
    return None


def test_device_barrier_mismatch_names_both_collectives():
    """On the transport the environment selects (ODC_TRANSPORT; default cuda):
    test_nvshmem_comm.py runs it over NVSHMEM, whose barrier words carry the collective too."""
    results = odc.launch(_mismatch_rank, 2, timeout=120)
    assert results[0] is not None and results[1] is not None, f"no error reported: {results}"
    code, message = results[0]
    assert code == odc._capi.REMOTE_ERROR, message
    assert "collective mismatch: rank 1 called minibatch_begin where this rank called barrier" in (
        message
    )
    code, message = results[1]
    assert code == odc._capi.REMOTE_ERROR, message
    assert "collective mismatch: rank 0 called barrier where this rank called minibatch_begin" in (
        message
    )


def _destroy_in_flight_rank(rank, world_size, key, count):
    import torch

    torch.cuda.set_device(rank)
    comm = odc.Comm(rank, world_size, key, timeout=30, device=rank)
    params = comm.alloc(count)
    shard = params.tensor()
    shard.fill_(rank + 1)
    del shard
    comm.barrier()
    torch.cuda.synchronize()
    out = torch.zeros(world_size * count, device="cuda")
    # The gather waits behind ~0.5 s of device sleep (longer on rank 1), so it has not run when
    # close() frees this rank's memory and closes its mappings of the peers' memory.
    torch.cuda._sleep(1_000_000_000 * (1 + rank))
    comm.gather(out, params)
    del params
    gc.collect()
    assert comm._num_views == 0  # so close() destroys now instead of deferring to the views
    comm.close()
    torch.cuda.synchronize()  # raises if the gather touched unmapped memory
    expected = torch.arange(1, world_size + 1, device="cuda", dtype=torch.float32)
    expected = expected.repeat_interleave(count)
    return bool(torch.equal(out, expected))


def test_destroy_waits_for_queued_and_peer_work():
    world_size = 2
    results = odc.launch(_destroy_in_flight_rank, world_size, 1 << 24, timeout=180)
    assert results == [True] * world_size


def _partial_sums_rank(rank, world_size, key, store_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc.torch
    from tiny_lm import loss_sum, make_model, minibatch_samples

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        device_id=device,
    )
    try:
        model = make_model().to(device)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        comm = odc.Comm(rank, world_size, key, timeout=3, device=rank)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)
        engine.minibatch_begin()
        if rank == 1:
            # Alive but silent: never reaches minibatch_end, so rank 0's device barrier expires
            # (after 3 s) and lets its stream go on with partial sums.
            time.sleep(12)
            comm.close()
            return None
        samples = [t.to(device) for t in minibatch_samples(0)]
        tokens = sum(int(t.shape[1]) - 1 for t in samples)
        odc.torch.scale_loss(loss_sum(model, samples[:3]), tokens).backward()
        engine.minibatch_end()  # enqueued: returns before the device barrier runs
        before = [p.to_local().detach().clone() for p in model.parameters()]
        try:
            optimizer.step()
            outcome = None
        except odc.Error as error:
            outcome = (error.code, str(error))
        torch.cuda.synchronize()
        unchanged = all(
            torch.equal(b, p.to_local().detach()) for b, p in zip(before, model.parameters())
        )
        comm.close()
        return outcome, unchanged
    finally:
        dist.destroy_process_group()


def test_no_optimizer_step_on_partial_sums_after_device_timeout():
    pytest.importorskip("torch")
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        results = odc.launch(_partial_sums_rank, 2, store, timeout=180)
    outcome, unchanged = results[0]
    assert outcome is not None, "optimizer.step() ran on partial sums"
    code, message = outcome
    assert code == odc._capi.TIMEOUT, message
    assert "no optimizer step may use them" in message
    assert "device barrier timed out" in message and "minibatch_end" in message, message
    assert unchanged, "the parameters changed"
