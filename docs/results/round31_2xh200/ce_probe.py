"""Copy-engine peer bandwidth between GPU 0 and GPU 1: torch's cross-device copy_ (a
cudaMemcpyPeerAsync), one direction alone and both directions at once (each direction's rate),
GB/s, the median of 25 (round 31, issue #47: could copy-engine puts bound NVSHMEM's streamed
pushes?).

  python3 ce_probe.py
"""

import time
import torch


def bw(nbytes, both):
    a0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b1 = torch.empty_like(a0, device="cuda:1")
    a1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    b0 = torch.empty_like(a1, device="cuda:0")
    s0 = torch.cuda.Stream("cuda:0")
    s1 = torch.cuda.Stream("cuda:1")
    times = []
    for i in range(25):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t = time.perf_counter()
        with torch.cuda.stream(s0):
            b1.copy_(a0, non_blocking=True)
        if both:
            with torch.cuda.stream(s1):
                b0.copy_(a1, non_blocking=True)
        s0.synchronize()
        s1.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


for mib in (16, 64, 256, 1024):
    print(
        f"{mib:5d} MiB  CE one way {bw(mib<<20, False):7.1f} GB/s   CE both ways (each) {bw(mib<<20, True):7.1f} GB/s",
        flush=True,
    )
