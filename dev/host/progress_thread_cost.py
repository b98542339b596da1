"""What the host progress thread (src/core/host_progress.h) costs a rank that waits outside odc:
the process's CPU time over a few seconds of sleep with a host-streamed minibatch open (the thread
looks every millisecond), against the same sleep between minibatches (it sleeps). 2 ranks on the
shm transport, one accumulator.

usage: python dev/host/progress_thread_cost.py [SECONDS]
"""

import resource
import sys
import time

import odc


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank(rank, world_size, key, seconds):
    import numpy as np

    with odc.Comm(rank, world_size, key, timeout=60) as comm:
        accumulator = comm.alloc(1024, accumulator=True)
        src = np.ones(world_size * 1024, dtype=np.float32)
        rows = []
        for phase in ("between minibatches", "inside a minibatch"):
            if phase == "inside a minibatch":
                comm.minibatch_begin()
                comm.scatter_accumulate(src, accumulator)
            else:
                comm.barrier()
            before, started = _cpu_seconds(), time.perf_counter()
            time.sleep(seconds)
            rows.append((phase, (_cpu_seconds() - before) / (time.perf_counter() - started)))
            if phase == "inside a minibatch":
                comm.minibatch_end()
    return rows


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    results = odc.launch(_rank, 2, seconds, timeout=120)
    print(f"{'rank':>4}  {'while the rank sleeps':<22}  {'CPU s per s':>11}")
    for rank, rows in enumerate(results):
        for phase, share in rows:
            print(f"{rank:>4}  {phase:<22}  {share:>11.4f}")


if __name__ == "__main__":
    main()
