"""The exceptions odc raises: one class per result code of the C API (odcResult_t), all under
`odc.Error` (docs/errors.md).

Invariant: a bad argument to anything in `odc`, `odc.torch` or `odc.train` raises
`InvalidArgument`, which is both an `odc.Error` and a `ValueError`; a valid call at the wrong
moment raises `InvalidUsage`, both an `odc.Error` and a `RuntimeError`. Every instance carries
`code`, the odcResult_t value, whether the library or the Python layer found the problem.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

# odcResult_t (include/odc/odc.h); tests/python/test_capi_layout.py checks them against the header.
SUCCESS = 0
INVALID_ARGUMENT = 1
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_USAGE = 4
TIMEOUT = 5
REMOTE_ERROR = 6
INTERRUPTED = 7


class Error(Exception):
    """A failure reported by odc. `code` is the odcResult_t value (odc.errors.INVALID_ARGUMENT,
    ...). Error(message, code) builds the subclass of that code's, as library failures do."""

    code: Optional[int] = None

    def __new__(cls, message: str = "", code: Optional[int] = None):
        if cls is Error and isinstance(code, int) and code in _CLASS_OF_CODE:
            cls = _CLASS_OF_CODE[code]
        return super().__new__(cls, message)

    def __init__(self, message: str = "", code: Optional[int] = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    def __reduce__(self):  # pickled with its code (launch() hands failures between processes)
        return (type(self), (str(self), self.code))


class InvalidArgument(Error, ValueError):
    """odcInvalidArgument: bad input from the caller; nothing was changed. The message names the
    argument."""

    code = INVALID_ARGUMENT


class SystemFailure(Error):
    """odcSystemError: the operating system refused (a file, memory, shared memory, CUDA)."""

    code = SYSTEM_ERROR


class InternalError(Error):
    """odcInternalError: a bug in odc; please report it with the message."""

    code = INTERNAL_ERROR


class InvalidUsage(Error, RuntimeError):
    """odcInvalidUsage: a valid call at the wrong moment (outside a minibatch, after close(),
    twice where once is allowed)."""

    code = INVALID_USAGE


class Timeout(Error):
    """odcTimeout: a wait on another rank ran past the communicator's timeout."""

    code = TIMEOUT


class RemoteError(Error):
    """odcRemoteError: another rank died, failed, or entered a different collective."""

    code = REMOTE_ERROR


class Interrupted(Error):
    """odcInterrupted: a wait on another rank was ended from outside (a signal, a close() from
    another thread)."""

    code = INTERRUPTED


_CLASS_OF_CODE: Dict[int, Type[Error]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        SystemFailure,
        InternalError,
        InvalidUsage,
        Timeout,
        RemoteError,
        Interrupted,
    )
}


def error_class(code: int) -> Type[Error]:
    """The class of an odcResult_t value (Error for a code this package does not know)."""
    return _CLASS_OF_CODE.get(code, Error)
