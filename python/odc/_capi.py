"""ctypes binding of the C API (include/odc/odc.h). The only module that touches the shared library.

The library is found, in order: $ODC_LIBRARY (a path to libodc.so), then next to this file (where
`pip install .` puts it).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import sys
import threading
from pathlib import Path


# odcResult_t and its exceptions live in odc.errors; `odc._capi.Error` stays importable (an alias
# of odc.Error) for code written before they moved.
from .errors import (  # noqa: F401 - re-exported
    INTERNAL_ERROR,
    INTERRUPTED,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    REMOTE_ERROR,
    SUCCESS,
    SYSTEM_ERROR,
    TIMEOUT,
    Error,
    InvalidArgument,
    error_class,
)

# odcDataType_t
FLOAT32 = 0
BFLOAT16 = 1

ODC_PLAN_ALL_SAMPLES = 2**63 - 1
PLAN_OPTIONS_MAGIC = 0x0DC09A4E
PLAN_OPTIONS_VERSION = 2


class PlanOptions(ctypes.Structure):
    """odcPlanOptions_t (make it with new_plan_options()). Every mirror here is checked against
    the C layout by tests/python/test_capi_layout.py."""

    _fields_ = [
        # The header (size, magic, version); size: what the library may read and write.
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("num_ranks", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("policy", ctypes.c_int),
        ("minibatch_size", ctypes.c_int64),
        ("cost_a", ctypes.c_double),
        ("cost_b", ctypes.c_double),
        ("cost_c", ctypes.c_double),
        ("rank_speed", ctypes.POINTER(ctypes.c_double)),
        ("num_rank_speeds", ctypes.c_size_t),
        ("split", ctypes.c_int),  # odcSplit_t
        ("split_exchange", ctypes.c_double),
        ("microbatch_memory", ctypes.c_int),  # odcMicrobatchMemory_t
        ("cost_floor", ctypes.c_double),
        ("steal", ctypes.c_int),  # version 2
    ]


SIMULATE_REQUEST_MAGIC = 0x0DC05133
SIMULATE_REQUEST_VERSION = 1
SIMULATE_UNSET = -1
SIMULATE_SFT, SIMULATE_GRPO = 0, 1  # odcSimulateTask_t


class SimulateRequest(ctypes.Structure):
    """odcSimulateRequest_t (make it with new_simulate_request()): `odc simulate`'s options,
    typed; SIMULATE_UNSET leaves an optional number to the command's default."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("lengths", ctypes.POINTER(ctypes.c_int64)),
        ("num_samples", ctypes.c_size_t),
        ("samples_per_rank", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("max_length", ctypes.c_int64),
        ("model", ctypes.c_char_p),
        ("layers", ctypes.c_int64),
        ("layer_params", ctypes.c_double),
        ("other_params", ctypes.c_double),
        ("cost_a", ctypes.c_double),
        ("cost_b", ctypes.c_double),
        ("cost_c", ctypes.c_double),
        ("cost_floor", ctypes.c_double),
        ("cost_calibrated_on", ctypes.c_int64),
        ("ranks", ctypes.POINTER(ctypes.c_int64)),
        ("num_rank_counts", ctypes.c_size_t),
        ("minibatches", ctypes.c_int64),
        ("policies", ctypes.c_char_p),
        ("modes", ctypes.c_char_p),
        ("task", ctypes.c_int),  # odcSimulateTask_t
        ("minibatches_per_step", ctypes.c_int64),
        ("split", ctypes.c_int),  # odcSplit_t
        ("split_exchange", ctypes.c_double),
        ("microbatch_memory", ctypes.c_int),  # odcMicrobatchMemory_t
        ("rank_speed", ctypes.POINTER(ctypes.c_double)),
        ("num_rank_speeds", ctypes.c_size_t),
        ("gpus_per_node", ctypes.c_int64),
        ("nvlink_gbytes", ctypes.c_double),
        ("nvlink_collective_gbytes", ctypes.c_double),
        ("network_gbits", ctypes.c_double),
        ("nvlink_latency_us", ctypes.c_double),
        ("network_latency_us", ctypes.c_double),
        ("forward_fraction", ctypes.c_double),
        ("transport_path", ctypes.c_char_p),
        ("gpu_memory_gbytes", ctypes.c_double),
    ]


# odcTransport_t
TRANSPORT_AUTO = 0
TRANSPORT_SHM = 1
TRANSPORT_CUDA = 2
TRANSPORT_NVSHMEM = 3
COMM_CONFIG_VERSION = 5
BOOTSTRAP_VERSION = 1

# odcBootstrap_t callbacks: 0 on success, nonzero on failure (see include/odc/odc.h).
BOOTSTRAP_ALLGATHER = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)
BOOTSTRAP_BARRIER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
BOOTSTRAP_MARK_FAILED = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
# odcSetInterruptCheck's callback: nonzero ends the wait.
INTERRUPT_CHECK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Bootstrap(ctypes.Structure):
    """odcBootstrap_t: a rendezvous supplied by the caller."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("ctx", ctypes.c_void_p),
        ("allgather", BOOTSTRAP_ALLGATHER),
        ("barrier", BOOTSTRAP_BARRIER),
        ("mark_failed", BOOTSTRAP_MARK_FAILED),
    ]


class CommConfig(ctypes.Structure):
    """odcCommConfig_t (make it with new_comm_config())."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("transport", ctypes.c_int),
        ("key", ctypes.c_char_p),
        ("timeout_seconds", ctypes.c_double),
        ("device", ctypes.c_int),
        ("deterministic", ctypes.c_int),
        ("bootstrap", ctypes.POINTER(Bootstrap)),  # version 2
        ("staging_bytes", ctypes.c_size_t),  # version 3
        ("ranks_per_node", ctypes.c_int),  # version 3
        ("node_cache_bytes", ctypes.c_size_t),  # version 4
        ("node_aggregation_bytes", ctypes.c_size_t),  # version 4
        ("cuda_sms", ctypes.c_int),  # version 5
        ("nvshmem_heap_bytes", ctypes.c_size_t),  # version 5
    ]


class MemoryNeed(ctypes.Structure):
    """odcMemoryNeed_t: bytes per rank by kind (odcMemoryNeed)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "published",
            "accumulators",
            "staging",
            "node_cache",
            "aggregation",
            "deterministic",
            "heap_bytes",
        )
    ]


# A budget of CommConfig taken from its environment variable (ODC_BYTES_FROM_ENVIRONMENT).
BYTES_FROM_ENVIRONMENT = ctypes.c_size_t(-1).value


def _find_library() -> str:
    override = os.environ.get("ODC_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise ImportError(f"ODC_LIBRARY={override!r} is not a file")
        return override
    bundled = Path(__file__).resolve().parent / "libodc.so"
    if bundled.is_file():
        return str(bundled)
    raise ImportError(
        f"libodc.so not found next to {__file__}; install the package with `pip install .` "
        "or point ODC_LIBRARY at a built libodc.so"
    )


# The C API's signatures, one (name, restype, argtypes) row per function, by area; _load applies
# them. Every function returns odcResult_t unless its row says otherwise.
_P = ctypes.POINTER
_RESULT = ctypes.c_int
_HANDLE = ctypes.c_void_p  # odcComm_t, odcBuffer_t, odcPlan_t
_STREAM = ctypes.c_void_p  # cudaStream_t
_SIZE = ctypes.c_size_t

_ERROR_AND_VERSION_FUNCTIONS = [
    ("odcGetErrorString", ctypes.c_char_p, [_RESULT]),
    ("odcGetLastError", ctypes.c_char_p, []),
    ("odcGetVersion", ctypes.c_int, []),
    ("odcHasCuda", ctypes.c_int, []),
]

_PLAN_FUNCTIONS = [
    ("odcPlanOptionsInit", _RESULT, [_P(PlanOptions)]),
    ("odcPolicyFromName", _RESULT, [ctypes.c_char_p, _P(ctypes.c_int)]),
    ("odcPlanCreate", _RESULT, [_P(ctypes.c_int64), _SIZE, _P(PlanOptions), _P(_HANDLE)]),
    ("odcPlanGetBubble", _RESULT, [_HANDLE, _P(ctypes.c_double), _P(ctypes.c_double)]),
    ("odcPlanToJson", _RESULT, [_HANDLE, _P(ctypes.c_char_p)]),
    ("odcPlanDestroy", _RESULT, [_HANDLE]),
    ("odcLengthsRead", _RESULT, [ctypes.c_char_p, _P(_P(ctypes.c_int64)), _P(_SIZE)]),
    ("odcLengthsFree", _RESULT, [_P(ctypes.c_int64)]),
    (
        "odcStealSimulate",
        _RESULT,
        [ctypes.c_int, _P(ctypes.c_int64)]
        + [_P(ctypes.c_double)] * 7
        + [_P(ctypes.c_int64), _P(ctypes.c_int64)],
    ),
    # The document (char**) is freed by odcSimulateFree, so kept as void*.
    ("odcSimulateRequestInit", _RESULT, [_P(SimulateRequest), _SIZE]),
    ("odcSimulateSweep", _RESULT, [_P(SimulateRequest), _P(_HANDLE)]),
    ("odcSimulate", _RESULT, [_P(ctypes.c_char_p), _SIZE, _P(ctypes.c_int64), _SIZE, _P(_HANDLE)]),
    ("odcSimulateFree", _RESULT, [ctypes.c_void_p]),
]

_COMM_FUNCTIONS = [
    (
        "odcCommInit",
        _RESULT,
        [_P(_HANDLE), ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_double],
    ),
    (
        "odcCommInitCuda",
        _RESULT,
        [_P(_HANDLE), ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_double, ctypes.c_int],
    ),
    ("odcCommConfigInit", _RESULT, [_P(CommConfig)]),
    ("odcCommInitConfig", _RESULT, [_P(_HANDLE), ctypes.c_int, ctypes.c_int, _P(CommConfig)]),
    ("odcCommConfigResolve", _RESULT, [_P(CommConfig), _P(CommConfig)]),
    (
        "odcMemoryNeed",
        _RESULT,
        [_P(CommConfig), ctypes.c_int, _SIZE, _SIZE, _P(MemoryNeed)],
    ),
    ("odcCommSplit", _RESULT, [_HANDLE, ctypes.c_int, ctypes.c_int, _P(_HANDLE)]),
    ("odcCommDestroy", _RESULT, [_HANDLE]),
    ("odcCommAbort", _RESULT, [_HANDLE, ctypes.c_char_p]),
    ("odcCommRank", _RESULT, [_HANDLE, _P(ctypes.c_int)]),
    ("odcCommWorldSize", _RESULT, [_HANDLE, _P(ctypes.c_int)]),
    ("odcCommGetMemory", _RESULT, [_HANDLE, _P(_SIZE), _P(_SIZE)]),
    ("odcCommGetNodeCacheBytes", _RESULT, [_HANDLE, _P(_SIZE)]),
    ("odcCommGetStreamStats", _RESULT, [_HANDLE, _P(ctypes.c_uint64), _P(ctypes.c_uint64)]),
    ("odcCommGetNodeTraffic", _RESULT, [_HANDLE, _P(ctypes.c_uint64), _P(ctypes.c_uint64)]),
    ("odcCommGetTopology", _RESULT, [_HANDLE, _P(ctypes.c_int), _P(ctypes.c_int)]),
    ("odcCommGetLastError", ctypes.c_char_p, [_HANDLE]),
    ("odcCommPollError", _RESULT, [_HANDLE]),
    ("odcSetInterruptCheck", _RESULT, [INTERRUPT_CHECK, ctypes.c_void_p]),
]

# odcBufferAllocNamed's; odcBufferAllocKind's too (the kind, an enum, is an int like the flag).
_BUFFER_ALLOC_NAMED_ARGS = [
    _HANDLE,
    _SIZE,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_char_p,
    _P(_HANDLE),
    _P(ctypes.c_void_p),
]
_BUFFER_FUNCTIONS = [
    (
        "odcBufferAlloc",
        _RESULT,
        [_HANDLE, _SIZE, ctypes.c_int, ctypes.c_int, _P(_HANDLE), _P(ctypes.c_void_p)],
    ),
    ("odcBufferAllocNamed", _RESULT, _BUFFER_ALLOC_NAMED_ARGS),
    ("odcBufferAllocKind", _RESULT, _BUFFER_ALLOC_NAMED_ARGS),
    ("odcBufferFree", _RESULT, [_HANDLE, _HANDLE]),
    ("odcAccumulatorKeepSums", _RESULT, [_HANDLE, _HANDLE]),
]

_COLLECTIVE_FUNCTIONS = [
    ("odcGather", _RESULT, [_HANDLE, ctypes.c_void_p, _SIZE, _HANDLE, _STREAM]),
    ("odcGatherAs", _RESULT, [_HANDLE, ctypes.c_void_p, _SIZE, ctypes.c_int, _HANDLE, _STREAM]),
    (
        "odcScatterAccumulate",
        _RESULT,
        [_HANDLE, ctypes.c_void_p, _SIZE, ctypes.c_int, _HANDLE, _STREAM],
    ),
    ("odcMinibatchBegin", _RESULT, [_HANDLE, _STREAM]),
    ("odcMinibatchEnd", _RESULT, [_HANDLE, _STREAM]),
    ("odcBarrier", _RESULT, [_HANDLE, _STREAM]),
    (
        "odcWorkBoardOpen",
        _RESULT,
        [_HANDLE, ctypes.c_int, _P(ctypes.c_int32), _P(ctypes.c_double)],
    ),
    ("odcWorkBoardTake", _RESULT, [_HANDLE, _P(ctypes.c_int32), _P(ctypes.c_int32)]),
    (
        "odcWorkBoardStats",
        _RESULT,
        [_HANDLE, _P(ctypes.c_int64), _P(ctypes.c_int64), _P(ctypes.c_int64), _P(ctypes.c_int64)],
    ),
]


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(_find_library())
    for table in (
        _ERROR_AND_VERSION_FUNCTIONS,
        _PLAN_FUNCTIONS,
        _COMM_FUNCTIONS,
        _BUFFER_FUNCTIONS,
        _COLLECTIVE_FUNCTIONS,
    ):
        for name, restype, argtypes in table:
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes
    return lib


lib = _load()

# Ctrl-C inside odc. Python's SIGINT handler only sets a flag that the interpreter looks at between
# bytecodes, so a rank waiting in C (a missing peer, an infinite timeout) would never see it. odc
# calls this check from its host waits on other ranks (every 20 ms at most): it runs Python's
# signal handlers, and what they raise (KeyboardInterrupt, or a handler's own exception) ends the
# wait (odcInterrupted, the communicator failed, peers name this rank) and is re-raised in the
# caller by check_comm(). Kept per thread: handlers run on the main thread, whose call it ends.
_pending = threading.local()
_check_signals = ctypes.pythonapi.PyErr_CheckSignals
_check_signals.argtypes = []
_check_signals.restype = ctypes.c_int


def hold_interrupt(error: BaseException) -> None:
    """Keeps `error` (raised inside a callback from C) for check_comm to re-raise in the caller."""
    if getattr(_pending, "error", None) is None:
        _pending.error = error


def take_interrupt_pending() -> bool:
    """Whether a signal handler's exception waits to be raised on this thread."""
    return getattr(_pending, "error", None) is not None


def take_interrupt() -> "BaseException | None":
    """The exception a signal handler raised during the last call on this thread, if any."""
    error = getattr(_pending, "error", None)
    _pending.error = None
    return error


def c_callback(function):
    """Marks a Python function called from C (through ctypes) as odc's: a KeyboardInterrupt (or a
    signal handler's exception) raised as it starts, before its own try block, goes to the stash
    instead of being printed and lost (ctypes reports it as unraisable and returns 0)."""
    function._odc_callback = True
    return function


def _unraisable(unraisable) -> None:
    callback = getattr(unraisable.object, "__func__", unraisable.object)
    error = unraisable.exc_value
    if (
        getattr(callback, "_odc_callback", False)
        and error is not None
        and not isinstance(error, Exception)
    ):
        hold_interrupt(error)
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook
sys.unraisablehook = _unraisable


@INTERRUPT_CHECK
@c_callback
def _interrupt_check(_ctx) -> int:
    try:
        if getattr(_pending, "error", None) is not None:
            return 1  # caught as a callback started (see c_callback)
        _check_signals()  # PyDLL: a pending handler's exception is raised here
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt and handlers' exceptions
        hold_interrupt(error)
        return 1
    return 0


lib.odcSetInterruptCheck(_interrupt_check, None)
# Finalizers that still call odc after the interpreter starts shutting down must not call back.
atexit.register(lambda: lib.odcSetInterruptCheck(INTERRUPT_CHECK(), None))


def check(result: int) -> None:
    """Raises for a failed call: InvalidArgument (a ValueError) with the library's message for
    invalid arguments, else the code's class of odc.Error, its message led by the code's name."""
    if result == SUCCESS:
        return
    message = lib.odcGetLastError().decode("utf-8", "replace")
    if result == INVALID_ARGUMENT:
        raise InvalidArgument(message)
    name = lib.odcGetErrorString(result).decode()
    raise error_class(result)(f"{name}: {message}", result)


def check_comm(result: int) -> None:
    """Raises the code's class of odc.Error for any failed communicator call; first, whatever a signal handler
    raised while the call waited (KeyboardInterrupt), with odc's message as a note."""
    interrupt = take_interrupt()
    if interrupt is not None:
        if result != SUCCESS and hasattr(interrupt, "add_note"):
            interrupt.add_note("odc: " + lib.odcGetLastError().decode("utf-8", "replace"))
        raise interrupt
    if result != SUCCESS:
        message = lib.odcGetLastError().decode("utf-8", "replace")
        if result == INVALID_USAGE and _REFUSED_THREAD in message:
            message = _name_python_threads(message)
        raise error_class(result)(message, result)


# A call refused because another thread is inside the same communicator names both threads by
# their kernel ids and OS names (odc.h); Python's names of those threads (threading.Thread.name,
# what a Python user set) replace the OS names here, in the error path only.
_REFUSED_THREAD = ": refused: thread "
_THREAD_ID = re.compile(r'\bthread (\d+)(?: \("[^"]*"\))?')


def _name_python_threads(message: str) -> str:
    names = {thread.native_id: thread.name for thread in threading.enumerate()}

    def named(match: "re.Match[str]") -> str:
        name = names.get(int(match.group(1)))
        return match.group(0) if name is None else f"thread {match.group(1)} ({name!r})"

    return _THREAD_ID.sub(named, message)


def new_simulate_request() -> SimulateRequest:
    """odcSimulateRequest_t with its header and the command's defaults."""
    request = SimulateRequest()
    check(lib.odcSimulateRequestInit(ctypes.byref(request), ctypes.sizeof(SimulateRequest)))
    return request


def new_plan_options() -> PlanOptions:
    """odcPlanOptions_t with its header (as ODC_PLAN_OPTIONS_INIT) and the library's defaults."""
    options = PlanOptions(
        size=ctypes.sizeof(PlanOptions), magic=PLAN_OPTIONS_MAGIC, version=PLAN_OPTIONS_VERSION
    )
    check(lib.odcPlanOptionsInit(ctypes.byref(options)))
    return options


def resolve_comm_config(config: CommConfig) -> CommConfig:
    """`config` with every field it leaves to the environment filled in as the library reads it
    (odcCommConfigResolve); raises InvalidArgument for an ODC_TIMEOUT or ODC_TRANSPORT init
    would refuse, naming it."""
    resolved = CommConfig(size=config.size, version=config.version)
    check(lib.odcCommConfigResolve(ctypes.byref(config), ctypes.byref(resolved)))
    return resolved


def new_comm_config() -> CommConfig:
    """odcCommConfig_t with its header (as ODC_COMM_CONFIG_INIT) and the library's defaults."""
    config = CommConfig(size=ctypes.sizeof(CommConfig), version=COMM_CONFIG_VERSION)
    check_comm(lib.odcCommConfigInit(ctypes.byref(config)))
    return config


def has_cuda() -> bool:
    """True when libodc.so was built with the CUDA transport."""
    return bool(lib.odcHasCuda())


def version() -> str:
    packed = lib.odcGetVersion()
    return f"{packed // 10000}.{packed // 100 % 100}.{packed % 100}"
