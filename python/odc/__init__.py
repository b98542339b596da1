"""odc: On-Demand Communication for sharded data-parallel training with variable-length data.

The core package needs numpy but not torch: it binds the C library (libodc.so) with ctypes.
"""

from ._capi import has_cuda, version
from .errors import (
    Error,
    InternalError,
    Interrupted,
    InvalidArgument,
    InvalidUsage,
    RemoteError,
    SystemFailure,
    Timeout,
)
from .comm import Buffer, Comm
from .launch import LaunchError, launch
from .planner import StealResult, plan, read_lengths, steal_minibatch, steal_span

__version__ = version()
__all__ = [
    "Buffer",
    "Comm",
    "Error",
    "InternalError",
    "Interrupted",
    "InvalidArgument",
    "InvalidUsage",
    "LaunchError",
    "has_cuda",
    "launch",
    "plan",
    "read_lengths",
    "RemoteError",
    "StealResult",
    "steal_minibatch",
    "steal_span",
    "SystemFailure",
    "Timeout",
    "__version__",
]
