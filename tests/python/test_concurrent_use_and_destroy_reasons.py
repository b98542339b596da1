"""One thread at a time per communicator, and why a peer destroyed its communicator, through the
Python API: a second thread entering a communicator while another thread is inside a call of it is
refused at once, naming both threads, and changes nothing; a peer waiting on a rank that destroys
its communicator after a sub-communicator failed there is told that failure, not only "destroyed its
communicator". Every rank runs in its own interpreter with a bounded wait, so a regression fails
instead of hanging.
"""

import os
import subprocess
import sys
import textwrap


def _key(name):
    return f"i41-{name}-{os.getpid()}"


def _rank(rank, world_size, key, body, timeout="20"):
    """A rank in a new interpreter: init, then `body` (`comm` in scope); stdin, stdout and stderr
    are pipes."""
    header = f"""
        import sys, threading, time, odc
        comm = odc.Comm({rank}, {world_size}, {key!r}, timeout=float({timeout!r}))
        """
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(header) + textwrap.dedent(body)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_thread_inside_a_communicator_is_refused_naming_both():
    # Rank 0's thread "pusher" waits in a barrier for rank 1 (which waits for a line on stdin);
    # the main thread's calls meanwhile are refused (odc.InvalidUsage) and change nothing: the
    # barrier completes and the communicator stays usable. Before, both threads ran the protocol
    # at once (concurrent pushes timed out with a sequence no rank had sent).
    key = _key("threads")
    rank0 = """
    acc = comm.alloc(8, accumulator=True)
    outcome = []
    def wait():
        comm.barrier()
        outcome.append("returned")
    waiter = threading.Thread(target=wait, name="pusher")
    waiter.start()
    deadline = time.monotonic() + 20
    while True:  # until the waiter holds the communicator
        try:
            comm.stream_stats()
        except odc.InvalidUsage as error:
            print("refused:", error, flush=True)
            break
        assert time.monotonic() < deadline, "never refused"
        time.sleep(0.001)
    print("ids:", threading.get_native_id(), waiter.native_id, flush=True)
    sys.stdin.readline()  # rank 1 may come now
    waiter.join()
    print(outcome, flush=True)
    comm.barrier()
    comm.minibatch_begin()
    comm.scatter_accumulate(__import__("numpy").ones(16, dtype="float32"), acc)
    comm.minibatch_end()
    print("sums:", acc.array.tolist(), flush=True)
    """
    rank1 = """
    acc = comm.alloc(8, accumulator=True)
    sys.stdin.readline()
    comm.barrier()
    comm.barrier()
    comm.minibatch_begin()
    comm.scatter_accumulate(__import__("numpy").ones(16, dtype="float32"), acc)
    comm.minibatch_end()
    """
    ranks = [_rank(0, 2, key, rank0), _rank(1, 2, key, rank1)]
    try:
        refused = ranks[0].stdout.readline().strip()
        ids = ranks[0].stdout.readline().split()
        for p in ranks:
            p.stdin.write("go\n")
            p.stdin.flush()
        out0, err0 = ranks[0].communicate(timeout=60)
        out1, err1 = ranks[1].communicate(timeout=60)
    finally:
        for p in ranks:
            p.kill()
    assert ranks[0].returncode == 0 and ranks[1].returncode == 0, (refused, err0, err1)
    main, pusher = ids[1], ids[2]
    assert refused == (
        f"refused: rank 0: odcCommGetStreamStats: refused: thread {main} ('MainThread') called it "
        f"while thread {pusher} ('pusher') is inside odcBarrier of the same communicator; a "
        "communicator is used by one thread at a time (give each thread its own, or serialize "
        "the calls): this call changed nothing and the other goes on"
    ), refused
    assert "['returned']" in out0, out0
    assert "sums: [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]" in out0, out0


def test_a_peer_learns_why_a_rank_destroyed_its_communicator_after_a_split_failed():
    # Rank 0 waits in its sub-communicator's barrier, rank 1 in the parent's (a program's
    # mistake); rank 0 times out and closes both. Rank 1 was told only "rank 0 destroyed its
    # communicator"; it learns the sub-communicator's failure.
    key = _key("child")
    body = """
    child = comm.split(0)
    try:
        (child if comm.rank == 0 else comm).barrier()
    except odc.Error as error:
        print(type(error).__name__, error, flush=True)
    child.close()
    comm.close()
    """
    ranks = [_rank(0, 2, key, body, "0.5"), _rank(1, 2, key, body, "30")]
    try:
        out0, err0 = ranks[0].communicate(timeout=60)
        out1, err1 = ranks[1].communicate(timeout=60)
    finally:
        for p in ranks:
            p.kill()
    assert out0.startswith(
        "Timeout split colour 0, parent ranks 0, 1: rank 0: barrier: timed out after 0.5 s"
    ), (out0, err0)
    assert out1.startswith(
        "RemoteError rank 1: barrier: rank 0 failed: rank 0: destroyed its communicator after a "
        "sub-communicator failed there: split colour 0, parent ranks 0, 1: rank 0: barrier: "
        "timed out after 0.5 s waiting for rank 1 in barrier"
    ), (out1, err1)
