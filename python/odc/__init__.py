"""odc: On-Demand Communication for sharded data-parallel training with variable-length data.

The core package needs numpy but not torch: it binds the C library (libodc.so) with ctypes.
"""

from ._capi import Error, has_cuda, version
from .comm import Buffer, Comm
from .launch import LaunchError, launch
from .planner import plan, read_lengths

__version__ = version()
__all__ = [
    "Buffer",
    "Comm",
    "Error",
    "LaunchError",
    "has_cuda",
    "launch",
    "plan",
    "read_lengths",
    "__version__",
]
