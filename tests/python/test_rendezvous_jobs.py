"""Jobs sharing a key, on the host transport: two jobs that use the same key never pair ranks
across jobs (they fail, naming the key and the collision; a job whose ranks had all met goes on),
and a job that fails or is killed by its launcher (torchrun SIGTERMs the survivors)
leaves nothing named in /dev/shm.

Ranks are plain interpreters that import only odc (no torch), so many trials stay cheap.
"""

import os
import random
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


# A rank of a job that runs while a second job claims its key. Per line read on stdin ("<key>
# <stop file>"): role "first" joins, says "met", then allocates and trains (a buffer made and freed
# and a minibatch of pushes per step, every sum checked) until the stop file exists (the ranks
# agree on it through a gather), and says "ok <steps>"; role "second" only tries to join.
_LIVE_RANK = textwrap.dedent(
    """
    import os, sys, numpy as np, odc
    role, rank = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    for line in sys.stdin:
        key, stop = line.split()
        try:
            with odc.Comm(rank, 2, key, timeout=10) as comm:
                if role == "second":
                    print("joined", flush=True)
                    continue
                print("met", flush=True)
                grads = comm.alloc(64, accumulator=True)
                flags = comm.alloc(1)
                seen = np.empty(2, dtype=np.float32)
                steps = 0
                while True:
                    scratch = comm.alloc(1 << 12)
                    comm.minibatch_begin()
                    comm.scatter_accumulate(np.full(128, rank + 1.0, np.float32), grads)
                    comm.minibatch_end()
                    assert np.array_equal(grads.array, np.full(64, 3.0, np.float32)), grads.array
                    scratch.free()
                    steps += 1
                    flags.array[0] = float(os.path.exists(stop))
                    comm.barrier()
                    comm.gather(seen, flags)
                    comm.barrier()
                    if seen.max() > 0:
                        break
            print("ok", steps, flush=True)
        except odc.Error as error:
            print("error", str(error).replace("\\n", " "), flush=True)
    """
)


def test_second_job_on_a_live_key_fails_alone(tmp_path):
    # Job C's ranks have met and train; job D starts 0-400 ms later with C's
    # key. D is refused at init naming the key; C goes on with exact sums, every time (C's
    # ranks are fixed once they met: D's cannot be among them). Before, C failed too
    # ("another job is using key ...: both jobs fail rather than pair ranks across jobs").
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    ranks = {
        (role, rank): subprocess.Popen(
            [sys.executable, "-c", _LIVE_RANK, role, str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in ("first", "second")
        for rank in range(2)
    }
    first = [ranks["first", r] for r in range(2)]
    second = [ranks["second", r] for r in range(2)]
    rng = random.Random(41)
    keys, verdicts = [], []
    try:
        for p in ranks.values():
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)
        for trial in range(12):
            key = f"jobs-live-{os.getpid()}-{trial}"
            stop = tmp_path / f"stop{trial}"
            keys.append(key)

            def send(processes, key=key, stop=stop):
                for p in processes:
                    p.stdin.write(f"{key} {stop}\n")
                    p.stdin.flush()

            send(first)
            for p in first:
                assert p.stdout.readline().strip() == "met", p.communicate(timeout=60)
            time.sleep(rng.uniform(0, 0.4))
            send(second)
            refused = [p.stdout.readline().strip() for p in second]
            stop.touch()
            trained = [p.stdout.readline().strip() for p in first]
            verdicts.append((trial, refused, trained))
    finally:
        for p in ranks.values():
            p.stdin.close()
        for p in ranks.values():
            p.wait(timeout=60)
        leaked = [name for key in keys for name in _odc_names(key)]
        _remove(leaked)
    for trial, refused, trained in verdicts:
        for line in refused:
            assert line.startswith("error") and "another job is using key" in line, verdicts
            assert f"jobs-live-{os.getpid()}-{trial}" in line and "in use" in line, verdicts
        for line in trained:
            assert line.split()[0] == "ok" and int(line.split()[1]) >= 1, verdicts
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
