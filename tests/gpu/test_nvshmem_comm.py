"""The GPU protocol suite (tests/gpu/test_cuda_comm.py) over the NVSHMEM transport, selected the
way a user selects it, by the launch environment (ODC_TRANSPORT=nvshmem), in both of its data
paths: NVSHMEM's own get / put-with-signal calls (ODC_NVSHMEM_DIRECT=0, the calls that cross
nodes) and direct NVLink loads/stores over NVSHMEM's mappings (ODC_NVSHMEM_DIRECT=1), and with
pretended node boundaries (ODC_LOCAL_WORLD_SIZE=2: on 4 GPUs two "nodes" of two; =1: every GPU
its own "node"): peers on other "nodes" through NVSHMEM's calls and, inside minibatches, their
published shards fetched once per node and minibatch (the core's node cache,
core/node_gather_cache.h). NVSHMEM streams (no remote
float add), so every sum here goes in chunks through the owners' staging rings and their devices'
folds. Skipped where the plugin libodc_nvshmem.so is not next to libodc.so (or
$ODC_NVSHMEM_PLUGIN).
"""

import gc
import os
import random
import re
import time
from pathlib import Path

import pytest

import odc

import test_cuda_comm as suite
import test_hardening_gpu as hardening


def _plugin_path():
    given = os.environ.get("ODC_NVSHMEM_PLUGIN")
    if given:
        return Path(given)
    return Path(odc._capi.lib._name).resolve().parent / "libodc_nvshmem.so"


pytestmark = pytest.mark.skipif(
    not _plugin_path().is_file(), reason=f"no NVSHMEM plugin at {_plugin_path()}"
)


@pytest.fixture(params=["api", "direct", "nodes2", "nodes1"])
def nvshmem(request, monkeypatch):
    # odc.launch spawns the ranks, which inherit this environment.
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "0" if request.param == "api" else "1")
    monkeypatch.delenv("ODC_NODE_CACHE_BYTES", raising=False)
    if request.param.startswith("nodes"):
        monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", request.param[len("nodes") :])
    else:
        monkeypatch.delenv("ODC_LOCAL_WORLD_SIZE", raising=False)
    return request.param


def _ranks_per_node(mode, world_size):
    return int(mode[len("nodes") :]) if mode.startswith("nodes") else world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvshmem_gather(nvshmem, world_size):
    suite.test_gather_equals_concatenated_shards(world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_nvshmem_scatter_accumulate_uneven_with_delays(nvshmem, world_size, src_dtype):
    suite.test_scatter_accumulate_uneven_with_delays(world_size, src_dtype)


@pytest.mark.parametrize("deterministic", [False, True])
def test_nvshmem_sums_valid_after_minibatch_end_without_barrier(nvshmem, deterministic):
    suite.test_sums_valid_after_minibatch_end_without_barrier(deterministic)


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvshmem_streamed_rings_wrap_on_a_tiny_budget(nvshmem, monkeypatch, world_size):
    """The streamed scheme at a 256 KiB staging budget: chunks of 8 KiB, the rings wrap many
    times a push and senders wait on the device for their owners' credit, while the owners' fold
    kernels add; exact sums with host and device delays (4 ranks on 2 GPUs share them: NVSHMEM
    runs several processes per GPU)."""
    monkeypatch.setenv("ODC_STAGING_BYTES", "256K")
    results = odc.launch(suite._minibatch_rank, world_size, 6, 65537, "bfloat16", True, timeout=300)
    assert results == [6] * world_size


def _owner_stream_busy_rank(rank, world_size, key, sleep_seconds, timeout, warm_up=False):
    """(warm_up: one minibatch of the same pushes before, so every kernel is loaded.)
    Rank 1's stream sleeps (a long kernel: the stand-in for a collective that waits for a peer)
    before its push, for 3x the communicator's timeout; rank 0 pushes 128 KiB slices at once,
    four times its ring at rank 1 (64 KiB budget), so it needs rank 1's folds all along. Checks
    the sums; returns the seconds this rank's push took on its stream."""
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    count = 1 << 15
    calibration = 10**8  # cycles of torch.cuda._sleep, timed once for this GPU's clock
    started = time.perf_counter()
    torch.cuda._sleep(calibration)
    torch.cuda.synchronize()
    clock_hz = calibration / (time.perf_counter() - started)
    with odc.Comm(rank, world_size, key, timeout=timeout, device=gpu) as comm:
        accumulator = comm.alloc(count, accumulator=True)
        src = torch.full((world_size * count,), rank + 1.0, device="cuda")
        torch.cuda.synchronize()
        if warm_up:
            comm.minibatch_begin()
            comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            torch.cuda.synchronize()
        comm.minibatch_begin()
        started = time.perf_counter()
        if rank == 1:
            torch.cuda._sleep(int(sleep_seconds * clock_hz))
        comm.scatter_accumulate(src, accumulator)
        pushed = torch.cuda.Event()
        pushed.record()
        pushed.synchronize()  # rank 0: its chunks all credited; rank 1: its sleep ended
        push_seconds = time.perf_counter() - started
        if rank == 0:
            # minibatch_end waits for rank 1's end, which comes after its sleep: start that wait
            # once the sleep is nearly over, or it would expire on its own.
            time.sleep(max(0.0, sleep_seconds - push_seconds))
        comm.minibatch_end()
        torch.cuda.synchronize()
        comm.poll_error()
        sums = accumulator.tensor()
        assert torch.equal(sums, torch.full_like(sums, world_size * (world_size + 1) / 2))
        comm.barrier()
        torch.cuda.synchronize()
    return push_seconds


def test_nvshmem_pushes_progress_while_the_owners_stream_is_busy(nvshmem, monkeypatch):
    """design.md's progress rule on the device: an owner folds in the fold kernels its
    odc calls enqueue on its stream; while that stream runs a long kernel (or waits in a
    collective) a sender with a full ring could only wait, and its credit wait expired (the
    communicator failed: `credit wait (scatter_accumulate) timed out`). The owner's progress
    thread now enqueues passes of the fold on the background stream, which run beside the
    sleeping stream: rank 0's push completes while rank 1's stream still sleeps, and every sum is
    exact. Here in the process's second minibatch (warm_up: a first one ran before); the first is
    the case below."""
    monkeypatch.setenv("ODC_STAGING_BYTES", "64K")
    timeout = 3
    seconds = odc.launch(_owner_stream_busy_rank, 2, 3 * timeout, timeout, True, timeout=120)
    # The premise: rank 1's stream slept well past the timeout, so without the progress thread
    # rank 0's credit wait would have expired (the launch raises then).
    assert seconds[1] > 2 * timeout
    # The progress: rank 0's push was credited while rank 1's stream still slept.
    assert seconds[0] < seconds[1] - timeout, seconds


def test_nvshmem_pushes_progress_in_the_first_minibatch(nvshmem, monkeypatch):
    """The same in the process's first minibatch. It failed there until the transport ran every
    kernel of a minibatch once at its start (2026-11-28, 2 x H200): the owner's first push, whose
    kernels were not loaded yet, sat in a launch until its stream's sleep ended, and the driver
    held the progress thread's launches of the fold with it, so rank 0's credit wait expired."""
    monkeypatch.setenv("ODC_STAGING_BYTES", "64K")
    timeout = 3
    seconds = odc.launch(_owner_stream_busy_rank, 2, 3 * timeout, timeout, False, timeout=120)
    assert seconds[1] > 2 * timeout
    assert seconds[0] < seconds[1] - timeout, seconds


def test_nvshmem_deterministic_bitwise_identical(nvshmem):
    suite.test_deterministic_sums_bitwise_identical_under_random_delays()


def test_nvshmem_thousand_minibatches(nvshmem):
    suite.test_thousand_minibatches_lose_nothing()


def test_nvshmem_silent_rank_times_out(nvshmem):
    suite.test_silent_rank_reports_timeout_instead_of_hanging()


def test_nvshmem_bad_input(nvshmem):
    suite.test_bad_input_is_refused_and_changes_nothing()


def test_nvshmem_dead_rank_named(nvshmem):
    suite.test_dead_rank_reports_timeout_naming_it()


def test_nvshmem_barrier_mismatch_names_both_collectives(nvshmem):
    """NVSHMEM's device barrier announces the collective with its epoch, so barrier()
    on one rank and minibatch_begin() on the other fail on both with "collective mismatch" naming
    both, worded as on the CUDA transport (it paired them silently before)."""
    hardening.test_device_barrier_mismatch_names_both_collectives()


def _which_transport(rank, world_size, key):
    import torch

    torch.cuda.set_device(rank)
    with odc.Comm(rank, world_size, key, timeout=30, device=rank, transport="nvshmem") as comm:
        assert comm.over_nvshmem  # what OdcFSDP asks before checking a model against the heap
        accumulator = comm.alloc(8, accumulator=True)
        comm.minibatch_begin()
        comm.scatter_accumulate(
            torch.full((world_size * 8,), rank + 1.0, device="cuda"), accumulator
        )
        comm.minibatch_end()
        torch.cuda.synchronize()
        total = accumulator.tensor().sum().item()
        comm.barrier()
        torch.cuda.synchronize()
    return total


def test_nvshmem_by_argument():
    # transport="nvshmem" without the environment: every owner holds 8 x (1 + 2) = 24.
    assert odc.launch(_which_transport, 2, timeout=180) == [24.0, 24.0]


def _shard(torch, minibatch, owner, count):
    index = torch.arange(count, device="cuda")
    return ((minibatch * 31 + owner * 7 + index) % 251).to(torch.float32) - 125.5


def _full(torch, minibatch, world_size, count):
    return torch.cat([_shard(torch, minibatch, owner, count) for owner in range(world_size)])


def _windows_rank(
    rank,
    world_size,
    key,
    num_minibatches,
    ranks_per_node,
    hierarchical,
    num_gpus=None,
    check_at_once=True,
):
    """Gathers inside minibatches (0 to 3 per rank, with host and device delays, so some ranks of
    a node gather nothing while others rely on what they fetch), of published shards that change
    every minibatch, as they are, as bfloat16 and narrowed (a bfloat16 buffer of odd size comes
    first, so a node cache that packed rows without alignment would misalign the float32 rows); a
    plain (unpublished) buffer rewritten inside each minibatch and gathered after a barrier there,
    which must never be served from a copy; a new buffer layout half way; gathers outside
    minibatches after rewriting. check_at_once=False: no host synchronization until the
    minibatch has ended (gathers queue behind device delays, and the minibatch's end must wait
    for them and for the node's fetch). Returns the bytes this rank should have fetched from
    other nodes: each minibatch's published remote shards once per node (hierarchical: the node
    cache) or every gather's."""
    import torch

    device = rank % (num_gpus or world_size)  # num_gpus < world_size: several ranks per GPU
    torch.cuda.set_device(device)
    rng = random.Random(1000 + rank)
    count, half_count, scratch_count = 10007, 4099, 3001
    remote_owners = world_size - ranks_per_node
    rows = remote_owners // ranks_per_node  # remote shards one rank fetches for its node
    fetched = 0
    with odc.Comm(rank, world_size, key, timeout=60, device=device) as comm:
        halves = comm.alloc(half_count, dtype="bfloat16", published=True)
        wide = comm.alloc(count, published=True)
        scratch = comm.alloc(scratch_count)  # rewritten inside minibatches: never cached
        accumulator = comm.alloc(count, accumulator=True)
        full = torch.empty(world_size * count, device="cuda")
        for minibatch in range(num_minibatches):
            if minibatch == num_minibatches // 2:  # another layout: its rows are made anew
                halves.free()
                half_count += 8
                halves = comm.alloc(half_count, dtype="bfloat16", published=True)
            # Owners rewrite their shards between minibatches (stream order after the barrier
            # that closed the last one).
            wide.tensor().copy_(_shard(torch, minibatch, rank, count))
            halves.tensor().copy_(_shard(torch, minibatch, rank, half_count).to(torch.bfloat16))
            comm.minibatch_begin()
            if hierarchical:
                fetched += rows * (count * 4 + half_count * 2)
            # A plain buffer, rewritten inside the minibatch under the caller's own barrier (as
            # a K/V exchange does): its gathers read the owners as they are now.
            scratch.tensor().copy_(_shard(torch, minibatch + 900, rank, scratch_count))
            comm.barrier()
            scratch_full = torch.empty(world_size * scratch_count, device="cuda")
            comm.gather(scratch_full, scratch)
            fetched += remote_owners * scratch_count * 4
            checks = [
                ("scratch", scratch_full, _full(torch, minibatch + 900, world_size, scratch_count))
            ]
            expected = _full(torch, minibatch, world_size, count)
            expected_halves = _full(torch, minibatch, world_size, half_count).to(torch.bfloat16)
            for _ in range(rng.randrange(4)):
                time.sleep(rng.uniform(0, 0.003))
                torch.cuda._sleep(rng.randint(0, 300_000))
                wide_full = torch.empty(world_size * count, device="cuda")
                narrowed = torch.empty(world_size * count, device="cuda", dtype=torch.bfloat16)
                half_full = torch.empty(
                    world_size * half_count, device="cuda", dtype=torch.bfloat16
                )
                comm.gather(wide_full, wide)
                comm.gather(narrowed, wide)
                comm.gather(half_full, halves)
                if not hierarchical:
                    fetched += remote_owners * (count * 4 * 2 + half_count * 2)
                checks += [
                    ("float32", wide_full, expected),
                    ("narrowed", narrowed, expected.to(torch.bfloat16)),
                    ("bfloat16", half_full, expected_halves),
                ]
                if check_at_once:
                    _compare(rank, minibatch, world_size, checks)
                    checks = []
            comm.scatter_accumulate(torch.ones(world_size * count, device="cuda"), accumulator)
            comm.minibatch_end()
            _compare(rank, minibatch, world_size, checks)
            comm.gather(full, accumulator)  # outside a window: read as always
            fetched += remote_owners * count * 4
            if not torch.equal(full, torch.full_like(full, float(world_size))):
                raise AssertionError(f"rank {rank} minibatch {minibatch}: wrong sums")
            # Rewritten outside a minibatch, then gathered outside one: the new values, not a
            # node cache's.
            wide.tensor().copy_(_shard(torch, minibatch + 500, rank, count))
            comm.barrier()
            comm.gather(full, wide)
            fetched += remote_owners * count * 4
            if not torch.equal(full, _full(torch, minibatch + 500, world_size, count)):
                raise AssertionError(f"rank {rank} minibatch {minibatch}: gather outside a window")
            comm.barrier()  # everyone has read before the next rewrite
        torch.cuda.synchronize()
        # No buffer view may outlive the block: close() then destroys the communicator at once
        # (else only when the last view goes), and its transport prints its statistics.
        del wide, halves, scratch, accumulator
        gc.collect()
    return fetched


def _compare(rank, minibatch, world_size, checks):
    import torch

    for name, got, want in checks:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].item()
            raise AssertionError(
                f"rank {rank} minibatch {minibatch} {name} gather, element {bad} "
                f"(owner {bad // (got.numel() // world_size)}): {got[bad].item()} "
                f"!= {want[bad].item()}"
            )


def _check_fetched(capfd, world_size, expected):
    # Each rank prints what it fetched from other nodes when it closes: exactly the bytes of one
    # fetch per minibatch and node (hierarchical: the node cache), or of every gather (flat).
    err = capfd.readouterr().err
    stats = re.findall(
        r"odc nvshmem rank (\d+): to/from other nodes: \d+ bytes put, (\d+) bytes fetched",
        err,
    )
    assert sorted(int(r) for r, _ in stats) == list(range(world_size)), err[-3000:]
    for rank, got in stats:
        assert int(got) == expected[int(rank)], (rank, got, expected[int(rank)])


def test_nvshmem_gathers_inside_minibatches(nvshmem, monkeypatch, capfd):
    world_size = min(4, suite._device_count())
    ranks_per_node = _ranks_per_node(nvshmem, world_size)
    hierarchical = ranks_per_node < world_size
    monkeypatch.setenv("ODC_NVSHMEM_STATS", "1")
    expected = odc.launch(_windows_rank, world_size, 12, ranks_per_node, hierarchical, timeout=300)
    _check_fetched(capfd, world_size, expected)


def test_nvshmem_node_fetch_fans_out_to_every_local_rank(monkeypatch, capfd):
    """Two "nodes" of two ranks on any machine with 2 GPUs: 4 ranks, ranks r and r + 2 on GPU
    r % 2 (NVSHMEM runs several processes per GPU), so each node spans both GPUs: a rank reads
    the shards its node peer fetched from that peer's cache over NVLink, after waiting for its
    ready word, while that peer may be gathering nothing at all."""
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "1")
    monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("ODC_NODE_CACHE_BYTES", raising=False)
    monkeypatch.setenv("ODC_NVSHMEM_STATS", "1")
    expected = odc.launch(_windows_rank, 4, 12, 2, True, 2, timeout=300)
    _check_fetched(capfd, 4, expected)


def test_nvshmem_late_node_fetch_is_waited_for(monkeypatch, capfd):
    """The node fetch starts 20 ms late (a test knob) and no rank synchronizes its host inside a
    minibatch: gathers queue on the device and must wait for the fetchers' ready words, and each
    rank's minibatch_end must wait for its own fetch before owners may rewrite."""
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "1")
    monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("ODC_NODE_CACHE_BYTES", raising=False)
    monkeypatch.setenv("ODC_NVSHMEM_TEST_FETCH_DELAY_US", "20000")
    monkeypatch.setenv("ODC_NVSHMEM_STATS", "1")
    expected = odc.launch(_windows_rank, 4, 8, 2, True, 2, False, timeout=300)
    _check_fetched(capfd, 4, expected)


def _aggregation_rank(
    rank, world_size, key, num_gpus, count, num_minibatches, mixed=True, num_accumulators=1
):
    """Pushes of a full gradient per minibatch (bf16 and fp32 alternately where `mixed`, else
    fp32, with device delays), on pretended nodes, with or without node-aggregated pushes (the
    environment says): exact sums. Relay rows are forwarded in fp32 (the node's partial sums),
    so only fp32 pushes compare bytes slice for slice."""
    import torch

    device = rank % num_gpus
    torch.cuda.set_device(device)
    rng = random.Random(2000 + rank)
    with odc.Comm(rank, world_size, key, timeout=60, device=device) as comm:
        # Several: with a budget for fewer relays, some are relayed and some pushed directly.
        accumulators = [comm.alloc(count, accumulator=True) for _ in range(num_accumulators)]
        full = torch.empty(world_size * count, device="cuda")
        for minibatch in range(num_minibatches):
            comm.minibatch_begin()
            torch.cuda._sleep(rng.randint(0, 200_000))
            dtype = torch.bfloat16 if mixed and minibatch % 2 else torch.float32
            src = torch.arange(world_size * count, device="cuda", dtype=torch.float32) % 61
            for accumulator in accumulators:
                comm.scatter_accumulate((src + rank + minibatch).to(dtype), accumulator)
            comm.minibatch_end()
            want = (src * world_size + sum(range(world_size)) + world_size * minibatch).float()
            for index, accumulator in enumerate(accumulators):
                comm.gather(full, accumulator)
                if not torch.equal(full, want):
                    bad = (full != want).nonzero()[0].item()
                    raise AssertionError(
                        f"rank {rank} minibatch {minibatch} accumulator {index}: element {bad} "
                        f"{full[bad].item()} != {want[bad].item()}"
                    )
        torch.cuda.synchronize()
        del accumulators, full
        gc.collect()
    return count


def _put_across(capfd, world_size):
    err = capfd.readouterr().err
    stats = re.findall(r"odc nvshmem rank (\d+): to/from other nodes: (\d+) bytes put", err)
    assert sorted(int(r) for r, _ in stats) == list(range(world_size)), err[-3000:]
    return {int(r): int(put) for r, put in stats}


def test_nvshmem_node_aggregated_pushes(monkeypatch, capfd):
    """Two "nodes" of two on 2 GPUs (ranks r and r + 2 on GPU r % 2): with node-aggregated
    pushes each rank puts one slice per minibatch to the other node (its relay row, forwarded
    at minibatch_end: the device fold awaits its node's ends first), without them two (fp32
    pushes); sums exact either way, with bf16 pushes too."""
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    monkeypatch.setenv("ODC_NVSHMEM_DIRECT", "1")
    monkeypatch.setenv("ODC_LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ODC_NVSHMEM_STATS", "1")
    count, minibatches = 70_001, 6
    put = {}
    for budget in ("0", "64M"):
        monkeypatch.setenv("ODC_NODE_AGGREGATION_BYTES", budget)
        odc.launch(_aggregation_rank, 4, 2, count, minibatches, False, timeout=300)
        put[budget] = _put_across(capfd, 4)
    odc.launch(_aggregation_rank, 4, 2, count, minibatches, True, timeout=300)
    # Room for one relay of two accumulators, small rings: relayed and direct pushes together
    # (a rank waiting for its node's ends still folds the other node's direct chunks).
    monkeypatch.setenv("ODC_NODE_AGGREGATION_BYTES", str(count * 4 + 4096))
    monkeypatch.setenv("ODC_STAGING_BYTES", "256K")
    odc.launch(_aggregation_rank, 4, 2, count, minibatches, True, 2, timeout=300)
    for rank in range(4):
        # Chunk headers ride along: compare the ratio, which is the slices per minibatch.
        assert put["0"][rank] == 2 * put["64M"][rank], (rank, put)
