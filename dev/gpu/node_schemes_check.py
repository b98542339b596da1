"""The core's node cache (issue #27 item 4: node-cached gathers of published buffers) on the GPUs
there are, several ranks per GPU and pretended node boundaries (ODC_LOCAL_WORLD_SIZE): exact
gathers (float32, bfloat16, narrowed) inside minibatches from the fetchers' rows, and the bytes
each rank fetched from other nodes (NVSHMEM's ODC_NVSHMEM_STATS line) equal to one fetch per
node and minibatch; memory per process with and without the cache. Correctness, bytes and memory
only: with ranks sharing a GPU, no timings. The transport, libraries and knobs come from the
environment (dev/gpu/run.sh node-schemes drives it).
  windows WORLD RANKS_PER_NODE MINIBATCHES AT_ONCE   the GPU suite's rank body
                           (tests/gpu/test_nvshmem_comm.py::_windows_rank) with every rank on GPU
                           0; AT_ONCE 0: no host synchronization inside minibatches. NVSHMEM:
                           checks the fetched bytes; the cache is on unless
                           ODC_NODE_CACHE_BYTES=0 or there is one node
  memory WORLD SHARD_MIB   GPU memory per process (nvidia-smi) after a published buffer's
                           minibatch, and odc's own count of the node cache
  aggregation WORLD RPN    NVSHMEM, streamed pushes with and without node aggregation
                           (ODC_NODE_AGGREGATION_BYTES=64M / 0): exact sums, and the bytes each
                           rank put to other nodes (aggregated: one slice per other node and
                           minibatch, direct: one per remote owner; fp32 pushes), then
                           aggregated with bf16 and fp32 pushes mixed: exact sums
  aggregation-mixed WORLD  two accumulators, ODC_NODE_AGGREGATION_BYTES (the caller's) with room
                           for one relay: relayed and direct pushes together, exact sums
"""

import os
import re
import sys
import tempfile

import odc
from streamed_check import _used_mib  # this folder: nvidia-smi's memory of one process


def _windows(world, ranks_per_node, minibatches, at_once):
    import test_nvshmem_comm as gpu_suite

    hierarchical = ranks_per_node < world and os.environ.get("ODC_NODE_CACHE_BYTES") != "0"
    nvshmem = os.environ.get("ODC_TRANSPORT") == "nvshmem"
    if nvshmem:
        os.environ["ODC_NVSHMEM_STATS"] = "1"
    # The ranks print their statistics to the inherited stderr when they close: catch it.
    with tempfile.TemporaryFile(mode="w+") as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            expected = odc.launch(
                gpu_suite._windows_rank,
                world,
                minibatches,
                ranks_per_node,
                hierarchical,
                1,
                at_once,
                timeout=400,
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        err = caught.read()
    sys.stderr.write(err[-2000:])
    if nvshmem:
        stats = re.findall(
            r"odc nvshmem rank (\d+): to/from other nodes: \d+ bytes put, (\d+) bytes fetched", err
        )
        got = {int(rank): int(fetched) for rank, fetched in stats}
        assert sorted(got) == list(range(world)), err[-3000:]
        for rank in range(world):
            assert got[rank] == expected[rank], (rank, got[rank], expected[rank])
        print(f"fetched from other nodes per rank: {[got[r] for r in range(world)]} (expected)")
    print(
        f"windows ok: {world} ranks, {ranks_per_node} per node, node cache "
        f"{'on' if hierarchical else 'off'}, {minibatches} minibatches"
    )


def _memory_rank(rank, world_size, key, shard_mib):
    import torch

    torch.cuda.set_device(0)
    count = shard_mib * (1 << 20) // 4
    with odc.Comm(rank, world_size, key, timeout=120, device=0) as comm:
        comm.barrier()
        torch.cuda.synchronize()
        before = _used_mib(os.getpid())
        params = comm.alloc(count, published=True)
        params.tensor().fill_(rank)
        out = torch.empty(world_size * count, device="cuda")
        comm.minibatch_begin()
        comm.gather(out, params)
        comm.minibatch_end()
        torch.cuda.synchronize()
        ok = all(bool((out[o * count : (o + 1) * count] == o).all()) for o in range(world_size))
        after = _used_mib(os.getpid())
        memory = comm.memory_bytes()
        del out, params
    return before, after, memory, ok


def _memory(world, shard_mib):
    results = odc.launch(_memory_rank, world, shard_mib, timeout=300)
    for rank, (before, after, memory, ok) in enumerate(results):
        assert ok, f"rank {rank}: wrong gather"
        print(
            f"rank {rank}: process {before} -> {after} MiB (+{after - before}) with a "
            f"{shard_mib} MiB published shard gathered in a minibatch; odc node cache "
            f"{memory['node_cache'] / (1 << 20):.2f} MiB, buffers "
            f"{memory['buffers'] / (1 << 20):.0f} MiB"
        )


def _aggregation(world, ranks_per_node):
    import test_nvshmem_comm as gpu_suite

    os.environ["ODC_NVSHMEM_STATS"] = "1"
    count, minibatches = 70_001, 6
    put = {}
    for budget in ("0", "64M"):
        os.environ["ODC_NODE_AGGREGATION_BYTES"] = budget
        with tempfile.TemporaryFile(mode="w+") as caught:
            saved = os.dup(2)
            os.dup2(caught.fileno(), 2)
            try:
                # fp32 pushes: relay rows go out in fp32, so slices compare byte for byte.
                odc.launch(
                    gpu_suite._aggregation_rank, world, 1, count, minibatches, False, timeout=300
                )
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            caught.seek(0)
            err = caught.read()
        stats = re.findall(r"odc nvshmem rank (\d+): to/from other nodes: (\d+) bytes put", err)
        put[budget] = {int(r): int(p) for r, p in stats}
        assert sorted(put[budget]) == list(range(world)), err[-3000:]
    # Aggregated with bf16 and fp32 pushes mixed: sums exact.
    odc.launch(gpu_suite._aggregation_rank, world, 1, count, minibatches, True, timeout=300)
    remote_owners = world - ranks_per_node
    rows = remote_owners // ranks_per_node
    for rank in range(world):
        assert put["0"][rank] * rows == remote_owners * put["64M"][rank], (rank, put)
    print(
        f"aggregation ok: {world} ranks, {ranks_per_node} per node, bytes put to other nodes "
        f"per rank: direct {[put['0'][r] for r in range(world)]}, aggregated "
        f"{[put['64M'][r] for r in range(world)]} ({remote_owners // rows}x fewer)"
    )


def _aggregation_mixed(world):
    """Two accumulators, a budget (set by the caller) with room for one relay: one relayed, one
    pushed directly, bf16 and fp32 pushes: exact sums."""
    import test_nvshmem_comm as gpu_suite

    odc.launch(gpu_suite._aggregation_rank, world, 1, 70_001, 6, True, 2, timeout=300)
    print(f"aggregation with relayed and direct accumulators ok: {world} ranks")


def main(argv):
    if argv[0] == "windows":
        _windows(int(argv[1]), int(argv[2]), int(argv[3]), argv[4] != "0")
    elif argv[0] == "aggregation":
        _aggregation(int(argv[1]), int(argv[2]))
    elif argv[0] == "aggregation-mixed":
        _aggregation_mixed(int(argv[1]))
    elif argv[0] == "memory":
        _memory(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
