"""Issue #41, the progress rule on the device: does the owner's progress pass run beside its
sleeping stream? Runs tests/gpu/test_nvshmem_comm.py's scenario (rank 1's stream sleeps 9 s
before its push, rank 0 pushes four rings' worth, timeout 3 s) once, with or without a warm-up
minibatch first (every kernel loaded before the sleep), under whatever CUDA_MODULE_LOADING says,
and prints one line: the seconds each rank's push took, or the failure.

  python dev/gpu/progress_lazy_loading.py [--warm-up]
"""

import os
import sys

import odc
from test_nvshmem_comm import _owner_stream_busy_rank

if __name__ == "__main__":
    warm_up = "--warm-up" in sys.argv
    os.environ.setdefault("ODC_STAGING_BYTES", "64K")
    label = f"loading={os.environ.get('CUDA_MODULE_LOADING', '(torch default)')} warm_up={warm_up}"
    try:
        seconds = odc.launch(_owner_stream_busy_rank, 2, 9, 3, warm_up, timeout=120)
        print(
            f"{label}: push seconds {seconds[0]:.3f} (rank 0), {seconds[1]:.3f} (rank 1) -> "
            + ("progress" if seconds[0] < seconds[1] - 3 else "no progress")
        )
    except odc.LaunchError as error:
        lines = [line for line in str(error).splitlines() if "odc.errors" in line]
        print(f"{label}: FAILED: " + " | ".join(lines)[:600])
