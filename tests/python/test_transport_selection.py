"""Choosing a transport by name (odc.Comm(transport=...), $ODC_TRANSPORT): bad names and bad
combinations are refused with a message naming them, and the NVSHMEM transport, where it cannot
run (no CUDA in this build, plugin missing, no GPU), says what is missing instead of crashing."""

import os
import subprocess
import sys

import numpy as np
import pytest

import odc


def test_unknown_transport_name_is_refused():
    with pytest.raises(odc.Error) as raised:
        odc.Comm(0, 1, f"sel-{os.getpid()}", transport="infiniband")
    assert raised.value.code == odc._capi.INVALID_ARGUMENT
    assert "'infiniband'" in str(raised.value) and "nvshmem" in str(raised.value)


def test_shm_takes_no_device_and_device_transports_need_one():
    with pytest.raises(odc.Error, match="takes no device"):
        odc.Comm(0, 1, f"sel-{os.getpid()}", device=0, transport="shm")
    with pytest.raises(odc.Error, match="needs a CUDA device"):
        odc.Comm(0, 1, f"sel-{os.getpid()}", transport="nvshmem")


def test_explicit_shm_transport_works():
    with odc.Comm(0, 1, f"sel-{os.getpid()}", transport="shm") as comm:
        params = comm.alloc(4)
        params.array[:] = 3.0
        full = np.empty(4, np.float32)
        comm.gather(full, params)
        assert list(full) == [3.0] * 4


def _unavailable_message(extra_env):
    # A fresh interpreter: the plugin is looked up once per process.
    code = (
        "import odc\n"
        "try:\n"
        "    odc.Comm(0, 1, 'sel-unavailable', device=0, transport='nvshmem')\n"
        "except odc.Error as error:\n"
        "    print('ERROR', error.code, error)\n"
    )
    env = dict(os.environ, **extra_env)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_nvshmem_unavailable_says_what_is_missing():
    out = _unavailable_message({"ODC_NVSHMEM_PLUGIN": "/nonexistent/libodc_nvshmem.so"})
    assert out.startswith("ERROR"), out
    if odc.has_cuda():
        assert "transport 'nvshmem' is unavailable" in out
        assert "/nonexistent/libodc_nvshmem.so" in out
    else:
        assert "odc was built without CUDA" in out


def test_odc_transport_environment_must_name_a_device_transport():
    code = (
        "import odc\n"
        "try:\n"
        "    odc.Comm(0, 1, 'sel-env', device=0)\n"
        "except odc.Error as error:\n"
        "    print('ERROR', error)\n"
    )
    env = dict(os.environ, ODC_TRANSPORT="carrier-pigeon")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "ODC_TRANSPORT='carrier-pigeon' is not a device transport" in done.stdout, (
        done.stdout + done.stderr
    )
