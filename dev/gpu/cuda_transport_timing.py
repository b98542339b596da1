"""The CUDA transport's data paths before and after a change, with both ranks on one GPU: a
same-basis ratio (both builds share the GPU the same way), not a bandwidth figure (the two ranks
contend for one GPU's SMs and memory; odc_bench needs one GPU per rank). The libraries come from
the environment (ODC_LIBRARY, PYTHONPATH), so the driver runs the same program on each build.
  python3 dev/gpu/cuda_transport_timing.py LABEL   prints one line per operation and size:
  label, operation, MiB per rank, median and min microseconds over 30 calls (slowest rank)
"""

import sys

import odc

SIZES_MIB = (1, 16, 64, 256)
CALLS = 30


def _rank(rank, world_size, key):
    import torch

    torch.cuda.set_device(0)
    results = []
    with odc.Comm(rank, world_size, key, timeout=120, device=0, transport="cuda") as comm:
        for mib in SIZES_MIB:
            total = mib * (1 << 20) // 4  # fp32 elements per rank: gathered output, pushed source
            shard = total // world_size
            params = comm.alloc(shard, published=True)
            acc = comm.alloc(shard, accumulator=True)
            params.tensor().fill_(rank)
            out = torch.empty(world_size * shard, device="cuda")
            src = torch.ones(world_size * shard, device="cuda")
            for op in ("gather", "scatter"):
                times = []
                comm.minibatch_begin()
                for call in range(CALLS + 3):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    if op == "gather":
                        comm.gather(out, params)
                    else:
                        comm.scatter_accumulate(src, acc)
                    end.record()
                    end.synchronize()
                    if call >= 3:  # warm-up calls left out
                        times.append(start.elapsed_time(end) * 1e3)
                comm.minibatch_end()
                times.sort()
                results.append((op, mib, times[len(times) // 2], times[0]))
            torch.cuda.synchronize()
            comm.barrier()
            del params, acc, out, src
    return results


def main(label):
    per_rank = odc.launch(_rank, 2, timeout=500)
    for i, (op, mib, _, _) in enumerate(per_rank[0]):
        median = max(r[i][2] for r in per_rank)
        least = max(r[i][3] for r in per_rank)
        print(f"{label} {op} {mib} MiB: median {median:.1f} us, min {least:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
