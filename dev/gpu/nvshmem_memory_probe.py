"""Where a process's GPU memory goes when odc runs over NVSHMEM (issue #31 item 2): the driver's
count of this process (nvidia-smi --query-compute-apps) and torch's reserved bytes after each
step of a training process's start, one torchrun per variant. Run under torchrun, one process per
GPU; rank 0 prints one table row per step, the rows of every rank in a JSON line at the end.

  torchrun --nproc_per_node N dev/gpu/nvshmem_memory_probe.py LABEL [ACCUMULATOR_MIB]

Steps: `cuda` (the CUDA context: one small tensor), `nccl` (torch's NCCL process group and one
all-reduce, as every training arm has), `odc` (odc's communicator: over NVSHMEM this starts
NVSHMEM with its heap, sized by ODC_NVSHMEM_HEAP_GIB / NVSHMEM_SYMMETRIC_SIZE from the
environment), `accumulator` (one accumulator of ACCUMULATOR_MIB per rank, default 256, and a
minibatch that pushes into it). The transport and NVSHMEM's knobs come from the environment, so
the stage that drives it compares NVSHMEM variants and the CUDA transport on the same steps.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from streamed_check import _used_mib  # this folder: nvidia-smi's memory of one process

MIB = 1 << 20


def main() -> int:
    label = sys.argv[1]
    accumulator_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    rows = []

    def step(name: str) -> None:
        torch.cuda.synchronize()
        rows.append(
            {
                "step": name,
                "driver_mib": _used_mib(os.getpid()),
                "torch_reserved_mib": torch.cuda.memory_reserved() // MIB,
            }
        )

    torch.zeros(1, device="cuda")
    step("cuda")
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    probe = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(probe)
    del probe
    step("nccl")
    from odc.torch.process_group import comm_from_process_group

    comm = comm_from_process_group(timeout=120)
    comm.barrier()
    step("odc")
    count = accumulator_mib * MIB // 4
    accumulator = comm.alloc(count, accumulator=True)
    source = torch.ones(world * count, device="cuda")
    comm.minibatch_begin()
    comm.scatter_accumulate(source, accumulator)
    comm.minibatch_end()
    del source
    torch.cuda.empty_cache()
    step("accumulator")
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        print(f"{label}: driver MiB per process by step (max over ranks), torch reserved MiB")
        for i, row in enumerate(rows):
            driver = max(r[i]["driver_mib"] for r in everyone)
            growth = driver - (max(r[i - 1]["driver_mib"] for r in everyone) if i else 0)
            print(
                f"  {row['step']:<12} driver {driver:>7} (+{growth:>6})  torch reserved "
                f"{row['torch_reserved_mib']:>6}"
            )
        print("JSON " + json.dumps({"label": label, "ranks": everyone}))
    comm.barrier()
    del accumulator
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
