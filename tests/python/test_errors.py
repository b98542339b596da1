"""One error policy (docs/errors.md): a bad argument anywhere in odc, odc.torch and odc.train
raises odc.InvalidArgument, an odc.Error and a ValueError, whose message names the argument,
whether Python or the C library found it; each C result code has its class."""

import ctypes
import math
import os
import pickle

import numpy as np
import pytest

import odc
from odc import _capi, errors


def _comm():
    return odc.Comm(0, 1, f"errors-{os.getpid()}")


def _gather(out):
    with _comm() as comm:
        buffer = comm.alloc(4)
        comm.gather(out, buffer)


def _alloc(**arguments):
    with _comm() as comm:
        comm.alloc(**arguments)


def _torch_engine_of(model):
    torch_module = pytest.importorskip("odc.torch")
    with _comm() as comm:
        torch_module.OdcFSDP(model, comm)


def _scale_loss(global_tokens):
    torch = pytest.importorskip("torch")
    from odc.torch import scale_loss

    scale_loss(torch.ones(()), global_tokens)


def _debug_mode(value, monkeypatch):
    pytest.importorskip("torch")
    from odc.torch.debug import mode_from_environment

    monkeypatch.setenv("ODC_DEBUG_COLLECTIVES", value)
    mode_from_environment()


def _fit(max_tokens):
    pytest.importorskip("torch")
    from odc.fit import fit_cost

    fit_cost({"model_type": "unused"}, max_tokens)


def _simulate(arguments):
    from odc.simulate import simulate

    simulate(arguments, lengths=[100, 200])


def _predict(mode):
    from odc.train.metrics import predict_minibatch

    predict_minibatch([], [], (1.0, 0.0, 0.0), mode)


def _plan(**changes):
    arguments = dict(lengths=[10, 20], ranks=2, max_tokens=100, policy="lb-mini")
    arguments.update(changes)
    odc.plan(**arguments)


# (what is called, the argument its message must name). Python checks and C checks alike.
CASES = {
    "plan ranks": (lambda mp: _plan(ranks="2"), "ranks"),
    "plan max_tokens (C)": (lambda mp: _plan(max_tokens=0), "max_tokens"),
    "plan policy (C)": (lambda mp: _plan(policy="fastest"), "fastest"),
    "plan cost": (lambda mp: _plan(cost=(1.0,)), "cost"),
    "plan split": (lambda mp: _plan(split="maybe"), "split"),
    "plan lengths": (lambda mp: _plan(lengths=[1.5]), "length"),
    "Comm rank": (lambda mp: odc.Comm(-1, 2, "k"), "rank"),
    "Comm world_size": (lambda mp: odc.Comm(0, "2", "k"), "world_size"),
    "Comm timeout": (lambda mp: odc.Comm(0, 1, "k", timeout=math.nan), "timeout"),
    "Comm transport": (lambda mp: odc.Comm(0, 1, "k", transport="ib"), "transport"),
    "Comm key (C)": (lambda mp: odc.Comm(0, 1, "bad/key"), "key"),
    "alloc count": (lambda mp: _alloc(count=-1), "count"),
    "alloc dtype": (lambda mp: _alloc(count=4, dtype="int8"), "dtype"),
    "alloc accumulator (C)": (
        lambda mp: _alloc(count=4, dtype="bfloat16", accumulator=True),
        "accumulator",
    ),
    "gather out": (lambda mp: _gather([0.0] * 4), "out"),
    "gather out size (C)": (lambda mp: _gather(np.zeros(3, np.float32)), "destination"),
    "launch world_size": (lambda mp: odc.launch(print, 0), "world_size"),
    "simulate --ranks": (lambda mp: _simulate(["--ranks", "x"]), "--ranks"),
    # The C API parses the command's options: a list typed with spaces is named as the command
    # names it.
    "simulate --ranks 8 16": (
        lambda mp: _simulate(["--ranks", "8", "16"]),
        "--ranks takes a comma-separated list without spaces, got '8 16': --ranks 8,16",
    ),
    "fit max_tokens": (lambda mp: _fit(2), "max_tokens"),
    "torch model": (lambda mp: _torch_engine_of(object()), "model"),
    "torch global_tokens": (lambda mp: _scale_loss(0), "global_tokens"),
    "torch ODC_DEBUG_COLLECTIVES": (
        lambda mp: _debug_mode("sometimes", mp),
        "ODC_DEBUG_COLLECTIVES",
    ),
    "train mode": (lambda mp: _predict("fastest"), "mode"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_raise_invalid_argument(case, monkeypatch):
    call, argument = CASES[case]
    with pytest.raises(odc.InvalidArgument) as raised:
        call(monkeypatch)
    error = raised.value
    assert isinstance(error, ValueError) and isinstance(error, odc.Error)
    assert error.code == errors.INVALID_ARGUMENT
    assert argument in str(error), str(error)


def test_result_codes_map_to_classes():
    expected = {
        errors.INVALID_ARGUMENT: (odc.InvalidArgument, ValueError),
        errors.SYSTEM_ERROR: (odc.SystemFailure, odc.Error),
        errors.INTERNAL_ERROR: (odc.InternalError, odc.Error),
        errors.INVALID_USAGE: (odc.InvalidUsage, RuntimeError),
        errors.TIMEOUT: (odc.Timeout, odc.Error),
        errors.REMOTE_ERROR: (odc.RemoteError, odc.Error),
        errors.INTERRUPTED: (odc.Interrupted, odc.Error),
    }
    assert len(expected) == len({c.code for c, _ in expected.values()}) == 7
    for code, (cls, also) in expected.items():
        assert errors.error_class(code) is cls and cls.code == code
        built = odc.Error("message", code)  # as library failures and older code build them
        assert type(built) is cls and isinstance(built, also) and built.code == code
        copy = pickle.loads(pickle.dumps(built))
        assert type(copy) is cls and copy.code == code and str(copy) == "message"
    assert _capi.Error is odc.Error  # the old private name still works


def test_library_failures_carry_their_class():
    with _comm() as comm:
        buffer = comm.alloc(4)
        with pytest.raises(odc.InvalidUsage, match="outside a minibatch|minibatch"):
            comm.scatter_accumulate(np.zeros(4, np.float32), comm.alloc(4, accumulator=True))
        buffer.free()
        with pytest.raises(odc.InvalidUsage):
            buffer.free()
    handle = ctypes.c_void_p()
    with pytest.raises(odc.InvalidArgument, match="world size"):
        _capi.check_comm(_capi.lib.odcCommInit(ctypes.byref(handle), 2, 2, b"k", 1.0))
