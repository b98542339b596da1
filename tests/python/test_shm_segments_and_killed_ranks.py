"""The host transport's shared-memory safeguards through the Python API: forged peer
segments refused, keys reserved for a job's life, nothing left in /dev/shm by killed ranks, a rank
that died during init named, infinite timeouts. Every wait is bounded, so a regression fails
instead of hanging.
"""

import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import odc


def _key(name):
    return f"hardrt-{name}-{os.getpid()}"


def _shm_files(key):
    return sorted(p.name for p in Path("/dev/shm").glob(f"odc.{key}.*"))


def _start_rank(rank, world_size, key, body, timeout=10, gated=False):
    """A rank in its own interpreter: init, then `body` (Python, `comm` in scope). `gated`: it
    imports odc, then waits for a line on stdin before init (_open_gates), so that ranks started
    one after another on a loaded machine reach init together."""
    gate = "import sys; print('ready', flush=True); sys.stdin.readline()" if gated else ""
    code = textwrap.dedent(
        f"""
        import os, signal, time, odc
        {gate}
        comm = odc.Comm({rank}, {world_size}, {key!r}, timeout=float({str(timeout)!r}))
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE if gated else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _open_gates(ranks):
    """Once every gated rank has imported odc (said "ready"), lets them all into init."""
    for p in ranks:
        assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)
    for p in ranks:
        p.stdin.write("go\n")
        p.stdin.flush()


def test_segment_open_to_others_is_refused():
    # A peer's control segment planted with mode 0666 (any local user could have made it) must be
    # refused with an error naming the file, not mapped as rank 1.
    key = _key("planted")
    path = Path(f"/dev/shm/odc.{key}.r1")
    path.write_bytes(b"\0" * 4096)
    os.chmod(path, 0o666)
    try:
        with pytest.raises(odc.Error) as raised:
            odc.Comm(0, 2, key, timeout=3)
        assert str(path) in str(raised.value) or path.name in str(raised.value)
        assert "mode" in str(raised.value) or "owner" in str(raised.value)
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second user",
)
def test_segment_of_another_user_is_refused():
    # Another user (uid 65534) plants a private-looking rank 1 (mode 0600, its own): refused too,
    # naming the owner, because only this uid's segments can be this job's peers.
    key = _key("otheruid")
    path = Path(f"/dev/shm/odc.{key}.r1")
    plant = f"import os; fd = os.open({str(path)!r}, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)"
    subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            sys.executable,
            "-c",
            plant,
        ],
        check=True,
        timeout=30,
    )
    try:
        assert path.stat().st_uid == 65534
        with pytest.raises(odc.Error) as raised:
            odc.Comm(0, 2, key, timeout=3)
        assert path.name in str(raised.value) and "owner uid 65534" in str(raised.value)
    finally:
        path.unlink(missing_ok=True)


def test_second_job_with_a_live_key_fails_at_init():
    key = _key("shared")
    hold = "comm.barrier(); time.sleep(6); comm.close()"
    first = [_start_rank(r, 2, key, hold) for r in range(2)]
    try:
        time.sleep(3)  # job 1 is past init and holds the key
        second = [_start_rank(r, 2, key, "comm.barrier(); print('joined')") for r in range(2)]
        outputs = [p.communicate(timeout=60) for p in second]
        assert all(p.returncode != 0 for p in second), outputs
        assert any("in use" in err for _, err in outputs), outputs
    finally:
        for p in first:
            p.communicate(timeout=60)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.001, 0.002, 0.004])
def test_rank_killed_during_alloc_leaves_nothing_in_dev_shm(delay):
    # Rank 1 is killed while allocating (its segment named but not yet unlinked); once every rank
    # has exited, nothing of the job may remain in /dev/shm.
    key = _key(f"leak{delay}")
    body = f"""
    import threading
    if comm.rank == 1:
        threading.Timer({delay}, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    buffer = comm.alloc(1 << 24)
    comm.barrier()
    """
    ranks = [_start_rank(r, 2, key, body, timeout=5) for r in range(2)]
    for p in ranks:
        p.communicate(timeout=60)
    leaked = _shm_files(key)
    for name in leaked:  # leave no debris behind, whatever the verdict
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert leaked == []


def test_rank_killed_during_init_is_named_dead():
    key = _key("initdeath")
    victim = _start_rank(1, 3, key, "")  # waits in init for ranks 0 and 2
    deadline = time.monotonic() + 60  # until it has joined (its control block exists)
    while f"odc.{key}.r1" not in _shm_files(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # ... and has written its pid into it (a rank killed in between is "not joined")
    victim.kill()
    victim.communicate(timeout=30)
    # Both survivors reach init together: the first to find rank 1 dead removes its debris, and
    # one that came later than that would only see a rank that never joined.
    survivors = [_start_rank(r, 3, key, "", timeout=15, gated=True) for r in (0, 2)]
    _open_gates(survivors)
    outputs = [p.communicate(timeout=120) for p in survivors]
    leaked = _shm_files(key)
    for name in leaked:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert all("rank 1" in err and "died" in err for _, err in outputs), outputs
    assert leaked == []


def test_infinite_timeout_waits():
    key = _key("inf")
    body = """
    if comm.rank == 1:
        time.sleep(2)
    comm.barrier()
    print("ok")
    """
    ranks = [_start_rank(r, 2, key, body, timeout=math.inf) for r in range(2)]
    outputs = [p.communicate(timeout=60) for p in ranks]
    assert all(p.returncode == 0 and "ok" in out for p, (out, _) in zip(ranks, outputs)), outputs
