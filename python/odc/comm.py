"""`odc.Comm`: a communicator on the host shared-memory transport, and its symmetric buffers.

One object per communicator, closed explicitly (or by a `with` block). Buffers expose their local
shard as a numpy array without copying; the array is valid until the buffer is freed or the
communicator closed.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from . import _capi

try:  # real bfloat16 arrays where ml_dtypes is installed; otherwise raw uint16 bits
    import ml_dtypes

    _BF16_NUMPY = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16_NUMPY = None

_DTYPES = {"float32": _capi.FLOAT32, "bfloat16": _capi.BFLOAT16}


def _invalid(message: str) -> _capi.Error:
    return _capi.Error(message, _capi.INVALID_ARGUMENT)


def _array_dtype(dtype: str) -> np.dtype:
    if dtype == "float32":
        return np.dtype(np.float32)
    return _BF16_NUMPY if _BF16_NUMPY is not None else np.dtype(np.uint16)


def _is_bf16_bits(array: np.ndarray) -> bool:
    return array.dtype == np.uint16 or (_BF16_NUMPY is not None and array.dtype == _BF16_NUMPY)


class Buffer:
    """A symmetric buffer: `count` elements of `dtype` on every rank; `array` is this rank's shard."""

    def __init__(
        self,
        comm: "Comm",
        handle: ctypes.c_void_p,
        local: int,
        count: int,
        dtype: str,
        accumulator: bool,
    ):
        self._comm = comm
        self._handle = handle
        self.count = count
        self.dtype = dtype
        self.accumulator = accumulator
        element = ctypes.c_float if dtype == "float32" else ctypes.c_uint16
        raw = np.ctypeslib.as_array(ctypes.cast(local, ctypes.POINTER(element)), shape=(count,))
        self._array = raw.view(_array_dtype(dtype))

    @property
    def array(self) -> np.ndarray:
        """This rank's shard (bfloat16 as uint16 bits unless ml_dtypes is installed)."""
        self._require_live()
        return self._array

    def free(self) -> None:
        """Collective: releases the buffer on every rank."""
        self._require_live()
        self._comm._call(_capi.lib.odcBufferFree, self._handle)
        self._handle = None

    def _require_live(self) -> None:
        if self._handle is None or self._comm._handle is None:
            raise _capi.Error("buffer used after free() or Comm.close()", _capi.INVALID_USAGE)


class Comm:
    """A communicator of `world_size` local processes that share `key` (see odc.launch).

    timeout: seconds any wait on another rank may take before failing (default: $ODC_TIMEOUT,
    else 60). A dead or silent peer raises odc.Error naming the rank and the operation.
    """

    def __init__(self, rank: int, world_size: int, key: str, timeout: Optional[float] = None):
        if not isinstance(key, str):
            raise _invalid(f"key must be a string, got {key!r}")
        handle = ctypes.c_void_p()
        _capi.check_comm(
            _capi.lib.odcCommInit(
                ctypes.byref(handle),
                int(rank),
                int(world_size),
                key.encode(),
                float(timeout) if timeout is not None else 0.0,
            )
        )
        self._handle = handle
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.key = key

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Frees the communicator and its buffers (local; idempotent)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _capi.check_comm(_capi.lib.odcCommDestroy(handle))

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing sensible to report
            pass

    def _call(self, function, *args) -> None:
        if self._handle is None:
            raise _capi.Error(
                f"rank {self.rank}: communicator used after close()", _capi.INVALID_USAGE
            )
        _capi.check_comm(function(self._handle, *args))

    # -- buffers ---------------------------------------------------------------------------
    def alloc(self, count: int, dtype: str = "float32", accumulator: bool = False) -> Buffer:
        """Collective: a symmetric buffer; every rank must pass the same arguments."""
        if dtype not in _DTYPES:
            raise _invalid(
                f"rank {self.rank}: alloc: unknown dtype {dtype!r}: "
                "expected 'float32' or 'bfloat16'"
            )
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise _invalid(
                f"rank {self.rank}: alloc: count must be a non-negative integer, " f"got {count!r}"
            )
        handle = ctypes.c_void_p()
        local = ctypes.c_void_p()
        self._call(
            _capi.lib.odcBufferAlloc,
            int(count),
            _DTYPES[dtype],
            int(bool(accumulator)),
            ctypes.byref(handle),
            ctypes.byref(local),
        )
        return Buffer(self, handle, local.value, int(count), dtype, bool(accumulator))

    # -- operations ------------------------------------------------------------------------
    def gather(self, out: np.ndarray, buffer: Buffer) -> None:
        """out[r*count:(r+1)*count] = rank r's shard, for every rank r."""
        buffer._require_live()
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise _invalid(
                f"rank {self.rank}: gather: out must be a writeable C-contiguous " "numpy array"
            )
        matches = out.dtype == np.float32 if buffer.dtype == "float32" else _is_bf16_bits(out)
        if not matches:
            raise _invalid(
                f"rank {self.rank}: gather: out has dtype {out.dtype}, the buffer "
                f"holds {buffer.dtype}"
            )
        self._call(_capi.lib.odcGather, out.ctypes.data, out.size, buffer._handle, None)

    def scatter_accumulate(
        self, src: np.ndarray, accumulator: Buffer, src_dtype: Optional[str] = None
    ) -> None:
        """Adds src[r*count:(r+1)*count] into rank r's accumulator, for every rank r (fp32).

        src is float32, or bfloat16 (ml_dtypes) or its uint16 bits with src_dtype="bfloat16".
        """
        accumulator._require_live()
        if not isinstance(src, np.ndarray):
            raise _invalid(f"rank {self.rank}: scatter_accumulate: src must be a numpy array")
        if src_dtype is None:
            if src.dtype == np.float32:
                src_dtype = "float32"
            elif _BF16_NUMPY is not None and src.dtype == _BF16_NUMPY:
                src_dtype = "bfloat16"
            else:
                raise _invalid(
                    f"rank {self.rank}: scatter_accumulate: src has dtype {src.dtype}; "
                    "expected float32, or uint16 bits with src_dtype='bfloat16'"
                )
        if src_dtype not in _DTYPES:
            raise _invalid(
                f"rank {self.rank}: scatter_accumulate: unknown src_dtype " f"{src_dtype!r}"
            )
        expected_ok = src.dtype == np.float32 if src_dtype == "float32" else _is_bf16_bits(src)
        if not expected_ok:
            raise _invalid(
                f"rank {self.rank}: scatter_accumulate: src has dtype {src.dtype}, "
                f"which does not hold {src_dtype}"
            )
        src = np.ascontiguousarray(src)
        self._call(
            _capi.lib.odcScatterAccumulate,
            src.ctypes.data,
            src.size,
            _DTYPES[src_dtype],
            accumulator._handle,
            None,
        )

    def minibatch_begin(self) -> None:
        """Collective: zeroes this rank's accumulators, then waits for every rank."""
        self._call(_capi.lib.odcMinibatchBegin, None)

    def minibatch_end(self) -> None:
        """Collective: returns when every rank's contributions are applied everywhere."""
        self._call(_capi.lib.odcMinibatchEnd, None)

    def barrier(self) -> None:
        """Collective: returns when every rank has called it."""
        self._call(_capi.lib.odcBarrier, None)
