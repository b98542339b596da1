"""Issue #41, the progress rule in a process's first minibatch on the device: do the owner's
progress passes run beside its sleeping stream there? Runs test_nvshmem_comm.py's scenario (rank
1's stream sleeps 9 s before its push, rank 0 pushes four rings' worth at a 64 KiB budget,
timeout 3 s) in the processes' first minibatch (or, with --warm-up, after one) and prints each
rank's push-call time and one line: each rank's push seconds, or the failure. Given a folder, 4 s
into the push it attaches cuda-gdb to each rank and writes every thread's native stack to
DIR/stacks_rank<R>.txt (where the owner's host and its progress thread sit while its stream
sleeps; the attach stops the process for seconds, so that run's timing is lost). With it the
twenty-second round found the owner's first push and its progress thread both inside
cuLaunchKernel until the sleep ended (before the transport warmed up its kernels).

  python dev/gpu/progress_first_minibatch.py DIR|- [--warm-up]     (-: no stacks)
"""

import os
import subprocess
import sys
import threading
import time

import odc


def _stacks(path):
    with open(path, "w") as out:
        started = time.perf_counter()
        done = subprocess.run(
            ["cuda-gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
        out.write(f"\n(cuda-gdb rc {done.returncode}, {time.perf_counter() - started:.1f} s)\n")


def _allow_tracing_by_children():
    # Under Yama's ptrace scope 1 a child may not trace its parent unless the parent says so.
    import ctypes

    pr_set_ptracer, any_process = 0x59616D61, ctypes.c_ulong(-1)
    ctypes.CDLL(None).prctl(pr_set_ptracer, any_process, 0, 0, 0)


def _rank(rank, world_size, key, folder, warm_up):
    import torch

    _allow_tracing_by_children()

    torch.cuda.set_device(rank % torch.cuda.device_count())
    count = 1 << 15
    calibration = 10**8
    started = time.perf_counter()
    torch.cuda._sleep(calibration)
    torch.cuda.synchronize()
    clock_hz = calibration / (time.perf_counter() - started)
    with odc.Comm(
        rank, world_size, key, timeout=3, device=rank % torch.cuda.device_count()
    ) as comm:
        accumulator = comm.alloc(count, accumulator=True)
        src = torch.full((world_size * count,), rank + 1.0, device="cuda")
        torch.cuda.synchronize()
        if warm_up:
            comm.minibatch_begin()
            comm.scatter_accumulate(src, accumulator)
            comm.minibatch_end()
            torch.cuda.synchronize()
        comm.minibatch_begin()
        timer = threading.Timer(4.0, _stacks, (os.path.join(folder, f"stacks_rank{rank}.txt"),))
        if folder:
            timer.start()
        started = time.perf_counter()
        if rank == 1:
            torch.cuda._sleep(int(9 * clock_hz))
        comm.scatter_accumulate(src, accumulator)
        returned = time.perf_counter() - started
        print(f"rank {rank}: the push call returned after {returned:.3f} s", flush=True)
        pushed = torch.cuda.Event()
        pushed.record()
        pushed.synchronize()
        push_seconds = time.perf_counter() - started
        if folder:
            timer.join()
        if rank == 0:
            time.sleep(max(0.0, 9 - push_seconds))
        comm.minibatch_end()
        torch.cuda.synchronize()
        comm.poll_error()
        comm.barrier()
        torch.cuda.synchronize()
    return returned, push_seconds


if __name__ == "__main__":
    folder = "" if sys.argv[1] == "-" else sys.argv[1]
    if folder:
        os.makedirs(folder, exist_ok=True)
    warm_up = "--warm-up" in sys.argv
    os.environ.setdefault("ODC_STAGING_BYTES", "64K")
    label = f"warm_up={warm_up} no_op_warm_up={os.environ.get('ODC_DIAG_NO_WARM_UP', '0')}"
    try:
        result = odc.launch(_rank, 2, folder, warm_up, timeout=180)
        print(
            f"{label}: push call returned after {result[0][0]:.3f} / {result[1][0]:.3f} s, "
            f"push done {result[0][1]:.3f} (rank 0), {result[1][1]:.3f} (rank 1) -> "
            + ("progress" if result[0][1] < result[1][1] - 3 else "no progress")
        )
    except odc.LaunchError as error:
        lines = [line for line in str(error).splitlines() if "odc.errors" in line]
        print(f"{label}: FAILED: " + " | ".join(lines)[:600])
