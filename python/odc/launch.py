"""`odc.launch`: run a function in `world_size` local processes that share a fresh key.

fn(rank, world_size, key, *args) runs in each process (started with the "spawn" method, so fn must
be importable: a module-level function). Return values come back in rank order. If any process
raises or exits without returning, LaunchError (an odc.Error) carries each failed rank's
traceback or exit status, and the results of the ranks that did return.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
import uuid
from typing import Any, Callable, Dict, Optional

from . import _capi
from .errors import InvalidArgument


# How long a rank that has returned its result may take to exit before it is killed.
_EXIT_GRACE_SECONDS = 30.0


class LaunchError(_capi.Error):
    """One or more launched ranks failed. `failures`: rank -> text; `results`: rank -> value."""

    def __init__(self, failures: Dict[int, str], results: Dict[int, Any]):
        lines = [f"{len(failures)} of {len(failures) + len(results)} ranks failed:"]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        super().__init__("\n".join(lines), _capi.REMOTE_ERROR)
        self.failures = failures
        self.results = results


def _share_cpu_threads(world_size: int) -> None:
    """Like torchrun: unless OMP_NUM_THREADS is set, each rank gets its share of the CPU cores.
    Ranks that each start one OpenMP thread per core oversubscribe the machine, and a rank that
    waits for its peers (ODC's minibatch barrier) then runs 10x slower on a small machine."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # already imported while unpickling the arguments
        sys.modules["torch"].set_num_threads(threads)


def _run_rank(fn: Callable, rank: int, world_size: int, key: str, args: tuple, conn) -> None:
    try:
        _share_cpu_threads(world_size)
        result = fn(rank, world_size, key, *args)
        conn.send(("ok", result))
    except BaseException:  # report everything, including SystemExit, to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _collect(processes, receivers, deadline, timeout, results, failures) -> None:
    """Waits for every rank's result or exit, or for the deadline."""
    pending = set(range(len(processes)))
    while pending:
        wait_for = None if deadline is None else max(0.0, deadline - time.monotonic())
        handles = [receivers[r] for r in pending] + [processes[r].sentinel for r in pending]
        if not multiprocessing.connection.wait(handles, timeout=wait_for):
            for rank in sorted(pending):
                processes[rank].kill()
                failures[rank] = f"did not finish within {timeout} s (killed)"
            return
        for rank in sorted(pending):
            message = None
            if receivers[rank].poll():
                try:
                    message = receivers[rank].recv()
                except EOFError:
                    message = None
            if message is not None:
                status, value = message
                (results if status == "ok" else failures)[rank] = value
                pending.discard(rank)
            elif not processes[rank].is_alive():
                processes[rank].join()
                failures[rank] = f"exited with code {processes[rank].exitcode} without returning"
                pending.discard(rank)


def launch(fn: Callable, world_size: int, *args, timeout: Optional[float] = None) -> list:
    """Runs fn(rank, world_size, key, *args) in world_size processes; returns results by rank.

    timeout: seconds the whole launch may take; ranks still running then are killed and reported.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size must be a positive integer, got {world_size!r}")
    context = multiprocessing.get_context("spawn")
    key = f"launch-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    processes, receivers = [], []
    for rank in range(world_size):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_run_rank, args=(fn, rank, world_size, key, args, sender))
        process.start()
        sender.close()
        processes.append(process)
        receivers.append(receiver)

    deadline = None if timeout is None else time.monotonic() + timeout
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    collected = False
    try:
        _collect(processes, receivers, deadline, timeout, results, failures)
        collected = True
    finally:
        # Ranks that returned get a moment to exit cleanly; after that (or after an interrupt
        # here) no rank outlives the launch.
        for process in processes:
            process.join(timeout=_EXIT_GRACE_SECONDS if collected else 0)
            if process.is_alive():
                process.kill()
                process.join()
    if failures:
        raise LaunchError(failures, results)
    return [results[rank] for rank in range(world_size)]
