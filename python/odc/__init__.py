"""odc: On-Demand Communication for sharded data-parallel training with variable-length data.

The core package needs neither torch nor numpy: it binds the C library (libodc.so) with ctypes.
"""

from ._capi import Error, version
from .planner import plan

__version__ = version()
__all__ = ["Error", "plan", "__version__"]
