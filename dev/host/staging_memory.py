"""Host memory of one accumulator under the shm transport's push scheme, measured, not computed:
2 ranks (processes), one fp32 accumulator with a shard of SHARD_MIB, a few minibatches of full
pushes, then the growth of /dev/shm's used bytes (tmpfs counts the mapped segments, unlinked or
not) per rank. Run it against any libodc (ODC_LIBRARY) to compare schemes.
Usage: ODC_LIBRARY=<libodc.so> python3 dev/host/staging_memory.py [SHARD_MIB=64] [STAGING_MIB=0]
(STAGING_MIB > 0 sets ODC_STAGING_BYTES for libraries that stream)."""

import os
import shutil
import sys

import numpy as np

import odc


def _used():
    return shutil.disk_usage("/dev/shm").used


def _rank(rank, world_size, key, shard, queue_path):
    with odc.Comm(rank, world_size, key, timeout=120) as comm:
        comm.barrier()
        before = _used()
        comm.barrier()
        accumulator = comm.alloc(shard, accumulator=True)
        src = np.ones(world_size * shard, np.float32)
        for _ in range(3):
            comm.minibatch_begin()
            for _ in range(2):
                comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            assert float(accumulator.array[0]) == 2 * world_size
        comm.barrier()
        after = _used()
        comm.barrier()
    return after - before


def main():
    shard_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    staging_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if staging_mib > 0:
        os.environ["ODC_STAGING_BYTES"] = f"{staging_mib}M"
    shard = shard_mib << 18  # fp32 elements
    grown = odc.launch(_rank, 2, shard, None, timeout=600)
    per_rank = max(grown) / 2
    print(
        f"library {os.environ.get('ODC_LIBRARY', '(installed)')}: shard {shard_mib} MiB, "
        f"staging budget {staging_mib or 'default'} MiB: /dev/shm grew {per_rank / 2**20:.0f} MiB "
        f"per rank = {per_rank / (shard_mib << 20):.2f} x the shard"
    )


if __name__ == "__main__":
    main()
