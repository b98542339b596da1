"""GPU memory per process of one deterministic accumulator, as the driver counts it (nvidia-smi),
for the libodc.so given: two ranks on the GPUs there are (several may share one). Prints one
line per rank: the accumulator's shard in MiB and the process's GPU memory before and after the
allocation (the CUDA context and odc's own fixed buffers are in "before").
Usage: ODC_LIBRARY=<libodc.so> python3 dev/gpu/deterministic_memory.py [MiB of shard, default 256]
"""

import os
import subprocess
import sys

import odc


def _used_mib(pid):
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields and fields[0] == str(pid):
            return int(fields[1])
    return -1


def _rank(rank, world_size, key, shard_mib):
    import torch

    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    with odc.Comm(rank, world_size, key, timeout=60, device=gpu, deterministic=True) as comm:
        comm.barrier()
        torch.cuda.synchronize()
        before = _used_mib(os.getpid())
        comm.barrier()
        accumulator = comm.alloc(shard_mib * (1 << 20) // 4, accumulator=True)
        comm.barrier()
        torch.cuda.synchronize()
        after = _used_mib(os.getpid())
        comm.barrier()
        del accumulator
    return before, after


if __name__ == "__main__":
    shard_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    for rank, (before, after) in enumerate(odc.launch(_rank, 2, shard_mib, timeout=300)):
        print(
            f"rank {rank}: shard {shard_mib} MiB, world 2, deterministic: GPU memory "
            f"{before} MiB before, {after} MiB after the accumulator: +{after - before} MiB "
            f"({(after - before) / shard_mib:.2f} x the shard)"
        )
