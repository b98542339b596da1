"""Issue 28 item 3 on the host transport: two jobs that use the same key never pair ranks across
jobs (they fail, naming the key and the collision), and a job that fails or is killed by its
launcher (torchrun SIGTERMs the survivors) leaves nothing named in /dev/shm.

Ranks are plain interpreters that import only odc (no torch), so many trials stay cheap.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Each rank runs one trial per line it reads on stdin (the line is the trial's key): init, publish
# its job's value, gather every rank's value, close. It prints the gathered values or the error.
_TRIAL_RANK = textwrap.dedent(
    """
    import sys, numpy as np, odc
    rank, value = int(sys.argv[1]), float(sys.argv[2])
    print("ready", flush=True)
    for line in sys.stdin:
        key = line.strip()
        try:
            with odc.Comm(rank, 2, key, timeout=10) as comm:
                shard = comm.alloc(1)
                shard.array[:] = value
                comm.barrier()
                full = np.empty(2, dtype=np.float32)
                comm.gather(full, shard)
                comm.barrier()
            print("ok", *full.tolist(), flush=True)
        except odc.Error as error:
            print("error", str(error).replace("\\n", " "), flush=True)
    """
)


def _odc_names(key):
    return sorted(p.name for p in Path("/dev/shm").glob(f"odc.{key}.*"))


def _remove(names):
    for name in names:  # leave no debris behind, whatever the verdict
        (Path("/dev/shm") / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "identity, trials",
    [("MASTER_PORT", 24), ("ODC_JOB_ID", 8)],
    ids=["torchrun-like", "by-hand-with-ODC_JOB_ID"],
)
def test_same_key_jobs_started_together_never_pair(identity, trials):
    # Two jobs launched at the same instant (as two torchrun jobs: each with its own MASTER_PORT;
    # or started by hand, each with its own ODC_JOB_ID) both pass the same key to odc.Comm. Job
    # C's ranks publish 1, job D's 100: a rank that gathers anything but its own job's values
    # was paired across jobs. Errors are fine.
    jobs = {"C": ("29511", 1.0), "D": ("29512", 100.0)}
    ranks = []
    for port, value in jobs.values():
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        if identity == "MASTER_PORT":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        else:
            env["ODC_JOB_ID"] = f"job-{port}"
        for rank in range(2):
            ranks.append(
                (
                    value,
                    subprocess.Popen(
                        [sys.executable, "-c", _TRIAL_RANK, str(rank), str(value)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=env,
                    ),
                )
            )
    crossed, errors, keys = [], [], []
    try:
        for _, p in ranks:
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)
        for trial in range(trials):
            key = f"jobs-{os.getpid()}-{trial}"
            keys.append(key)
            # Alternate which job is let in first, so either may win any rank's claim.
            order = ranks if trial % 2 == 0 else ranks[::-1]
            for _, p in order:
                p.stdin.write(key + "\n")
                p.stdin.flush()
            for value, p in ranks:
                words = p.stdout.readline().split()
                assert words, p.communicate(timeout=60)
                if words[0] == "ok":
                    if [float(w) for w in words[1:]] != [value, value]:
                        crossed.append((trial, value, words))
                else:
                    errors.append(" ".join(words))
    finally:
        for _, p in ranks:
            p.stdin.close()
        for _, p in ranks:
            p.wait(timeout=60)
        leaked = [name for key in keys for name in _odc_names(key)]
        _remove(leaked)
    assert crossed == [], crossed
    assert errors, "the jobs never collided: the test did not test anything"
    # Every error names the collision, except that a rank whose own job's other rank lost its
    # claim may instead time out waiting for it (its init then never formed a communicator:
    # no pairing either way).
    named = [e for e in errors if "another job is using key" in e or "in use" in e]
    unexplained = [e for e in errors if e not in named and "waiting for rank" not in e]
    assert named and unexplained == [], errors
    assert leaked == []


def _start(rank, world_size, key, body):
    code = textwrap.dedent(
        f"""
        import os, sys, time, odc
        comm = odc.Comm({rank}, {world_size}, {key!r}, timeout=30)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_second_job_on_a_live_key_fails_both_jobs():
    # Job C runs; job D starts with C's key. A job whose ranks had paired with D's (had they
    # started at the same instant) cannot be told from C, so both fail, naming the collision,
    # rather than go on.
    key = f"jobs-live-{os.getpid()}"
    first = [
        _start(r, 2, key, "print('joined', flush=True); time.sleep(3); comm.barrier()")
        for r in range(2)
    ]
    try:
        for p in first:
            assert p.stdout.readline().strip() == "joined", p.communicate(timeout=60)
        second = [_start(r, 2, key, "comm.barrier()") for r in range(2)]
        outputs = [p.communicate(timeout=60) for p in second + first]
    finally:
        leaked = _odc_names(key)
        _remove(leaked)
    for p, (_, err) in zip(second + first, outputs):
        assert p.returncode != 0 and "another job is using key" in err and key in err, outputs
    assert leaked == []


def test_job_whose_rank_fails_and_survivor_gets_sigterm_leaves_nothing():
    # As torchrun ends a job: rank 1 fails mid-run, the launcher SIGTERMs the survivor (no Python
    # cleanup runs then). Buffers, staging and control blocks: nothing of the job stays named.
    key = f"jobs-term-{os.getpid()}"
    body = """
    buffer = comm.alloc(1 << 16)
    comm.minibatch_begin()
    comm.barrier()
    if comm.rank == 1:
        sys.exit("rank 1 fails")
    print("running", flush=True)
    time.sleep(60)
    """
    ranks = [_start(r, 2, key, body) for r in range(2)]
    try:
        assert ranks[0].stdout.readline().strip() == "running", ranks[0].communicate(timeout=60)
        assert ranks[1].wait(timeout=60) != 0
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=60) == -signal.SIGTERM
        for p in ranks:
            p.communicate(timeout=60)
        time.sleep(0.1)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        leaked = _odc_names(key)
        _remove(leaked)
    assert leaked == []
