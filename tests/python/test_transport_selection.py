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


def test_the_library_resolves_what_the_arguments_leave_unset(monkeypatch):
    # One reader of the variables (src/core/comm_config.cc): Python asks it, never parses them.
    from odc import _capi
    from odc.comm import default_transport

    for knob in ("ODC_TRANSPORT", "ODC_TIMEOUT", "ODC_STAGING_BYTES", "ODC_CUDA_SMS"):
        monkeypatch.delenv(knob, raising=False)
    assert default_transport(None) == "shm" and default_transport(0) == "cuda"
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    assert default_transport(0) == "nvshmem" and default_transport(None) == "shm"
    monkeypatch.setenv("ODC_TRANSPORT", "carrier-pigeon")
    with pytest.raises(odc.InvalidArgument, match="ODC_TRANSPORT='carrier-pigeon'"):
        default_transport(0)
    monkeypatch.delenv("ODC_TRANSPORT")
    monkeypatch.setenv("ODC_TIMEOUT", "2.5")
    monkeypatch.setenv("ODC_STAGING_BYTES", "64K")
    config = _capi.new_comm_config()
    resolved = _capi.resolve_comm_config(config)
    assert resolved.timeout_seconds == 2.5 and resolved.staging_bytes == 64 << 10
    assert resolved.transport == _capi.TRANSPORT_SHM and resolved.cuda_sms == 0
    config.staging_bytes = 4096  # the argument wins
    assert _capi.resolve_comm_config(config).staging_bytes == 4096
    monkeypatch.setenv("ODC_STAGING_BYTES", "lots")  # named at init, where it is used
    assert _capi.resolve_comm_config(_capi.new_comm_config()).staging_bytes == (
        _capi.BYTES_FROM_ENVIRONMENT
    )
    monkeypatch.setenv("ODC_TIMEOUT", "-5")
    with pytest.raises(odc.InvalidArgument, match="ODC_TIMEOUT='-5' is not a timeout"):
        odc.Comm(0, 1, f"sel-{os.getpid()}")
    with pytest.raises(odc.InvalidArgument, match="cuda_sms must be"):
        odc.Comm(0, 1, f"sel-{os.getpid()}", timeout=1, cuda_sms=0)
