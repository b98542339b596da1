"""`odc.Comm`: a communicator and its symmetric buffers, on the host or on GPUs.

One object per communicator, closed explicitly (or by a `with` block).
- Host (`device=None`): buffers expose their shard as a numpy array (`buffer.array`), operations
  take numpy arrays and complete before returning.
- GPU (`device=<CUDA index>`, one process per GPU): buffers are device memory usable from torch
  (`buffer.tensor()`) and CuPy (`__cuda_array_interface__`) without copies; operations take torch
  CUDA tensors or `__cuda_array_interface__` arrays, are enqueued on `stream` (default: torch's
  current stream when torch is loaded, else the legacy default stream) and return at once.
View lifetime (never a crash): a view (`buffer.array`, `buffer.tensor()`) holds its buffer, which
holds its communicator, so dropping the `Comm` or `Buffer` object never unmaps memory a view still
uses. `buffer.free()` raises while views of that buffer are alive (delete them first); on every
rank it is refused before any communication, so call it where all ranks have dropped their views.
`comm.close()` never raises for live views: the communicator is closed for use at once (every call
raises) and its memory stays mapped until the last view is gone. Device buffers consumed through
`__cuda_array_interface__` directly (CuPy, Numba) hold the Buffer alive but are not counted: free()
or close() while such a consumer still uses the memory is the caller's error.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _capi, nvshmem_heap
from .errors import InvalidArgument, InvalidUsage

try:  # real bfloat16 arrays where ml_dtypes is installed; otherwise raw uint16 bits
    import ml_dtypes

    _BF16_NUMPY = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16_NUMPY = None

_DTYPES = {"float32": _capi.FLOAT32, "bfloat16": _capi.BFLOAT16}
# odcBufferKind_t (odcBufferShards = 0).
_BUFFER_ACCUMULATOR = 1
_BUFFER_PUBLISHED = 2


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message)


def _array_dtype(dtype: str) -> np.dtype:
    if dtype == "float32":
        return np.dtype(np.float32)
    return _BF16_NUMPY if _BF16_NUMPY is not None else np.dtype(np.uint16)


def _is_bf16_bits(array: np.ndarray) -> bool:
    return array.dtype == np.uint16 or (_BF16_NUMPY is not None and array.dtype == _BF16_NUMPY)


def _torch_dtype(torch, dtype: str):
    return torch.float32 if dtype == "float32" else torch.bfloat16


def _device_array(obj: Any, what: str) -> Tuple[int, int, str]:
    """(device pointer, element count, "float32" | "bfloat16" | other) of a contiguous GPU array."""
    if type(obj).__module__.split(".")[0] == "torch":
        if not obj.is_cuda or not obj.is_contiguous():
            raise _invalid(f"{what} must be a contiguous CUDA tensor")
        kind = {
            "torch.float32": "float32",
            "torch.bfloat16": "bfloat16",
            "torch.uint16": "bfloat16",
        }.get(str(obj.dtype), str(obj.dtype))
        return obj.data_ptr(), obj.numel(), kind
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is None:
        raise _invalid(f"{what} must be a CUDA tensor or expose __cuda_array_interface__")
    shape = tuple(interface["shape"])
    count = int(np.prod(shape)) if shape else 1
    typestr = interface["typestr"]
    strides = interface.get("strides")
    itemsize = int(typestr[2:])
    dense = tuple(int(np.prod(shape[i + 1 :])) * itemsize for i in range(len(shape)))
    if strides is not None and tuple(strides) != dense:
        raise _invalid(f"{what} must be C-contiguous")
    kind = {"<f4": "float32", "<u2": "bfloat16"}.get(typestr, typestr)
    return int(interface["data"][0]), count, kind


def _stream_handle(stream: Any, device: Optional[int]) -> Optional[int]:
    """A cudaStream_t as an int: the given one (int, torch or CuPy stream), else torch's current
    stream when torch is in use, else None (the legacy default stream). None on host comms."""
    if device is None:
        return None
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_stream(device).cuda_stream
        return None
    for attribute in ("cuda_stream", "ptr"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    return int(stream)


_INT_MAX = 2**31 - 1  # C int: ranks, world sizes and device indices
_NAME_MAX = 256  # characters of a buffer name (odcBufferAllocNamed)
_COUNT_MAX = 2**63 - 1  # size_t counts the C API can check (it refuses what does not fit memory)


def _checked_int(value: Any, what: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; ctypes would silently truncate anything wider."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _invalid(f"{what} must be an integer, got {value!r}")
    if not low <= int(value) <= high:
        raise _invalid(f"{what} must be in [{low}, {high}], got {int(value)}")
    return int(value)


def _optional_int(value: Any, what: str, low: int, high: int) -> Optional[int]:
    """None, or `value` checked as _checked_int does."""
    return None if value is None else _checked_int(value, what, low, high)


def _bytes_or_environment(value: Optional[int]) -> int:
    """A CommConfig budget: the given bytes, or None for its environment variable's."""
    return _capi.BYTES_FROM_ENVIRONMENT if value is None else int(value)


_TRANSPORTS = {
    "shm": _capi.TRANSPORT_SHM,
    "cuda": _capi.TRANSPORT_CUDA,
    "nvshmem": _capi.TRANSPORT_NVSHMEM,
}


def _check_transport(transport: Optional[str], device: Optional[int]) -> None:
    if transport is not None and transport not in _TRANSPORTS:
        raise _invalid(f"transport must be one of {sorted(_TRANSPORTS)} or None, got {transport!r}")
    if transport is not None and (transport == "shm") != (device is None):
        raise _invalid(
            f"transport {transport!r} "
            + ("takes no device" if transport == "shm" else "needs a CUDA device (device=...)")
        )


def default_transport(device: Optional[int]) -> str:
    """The transport odc.Comm(device=device) uses when no transport is given, as the library
    resolves it: "shm" without a device; with one, $ODC_TRANSPORT ("cuda", "nvshmem"), else
    "cuda". Raises InvalidArgument for an $ODC_TRANSPORT (or $ODC_TIMEOUT) init would refuse."""
    config = _capi.new_comm_config()
    config.device = -1 if device is None else _checked_int(device, "device", 0, _INT_MAX)
    resolved = _capi.resolve_comm_config(config)
    return next(name for name, value in _TRANSPORTS.items() if value == resolved.transport)


def _check_rendezvous(key: Any, store: Any) -> None:
    if key is None and store is None:
        raise _invalid("give a rendezvous key, or a store to meet through (store=...)")
    if key is not None and store is not None:
        raise _invalid("give a rendezvous key or a store, not both")
    if key is not None and not isinstance(key, str):
        raise _invalid(f"key must be a string, got {key!r}")
    if key is not None and "\0" in key:
        raise _invalid(f"key must not contain a NUL character, got {key!r}")


def _check_timeout(timeout: Any) -> None:
    """Refuses a timeout that is not a positive number of seconds (inf included) or None (the
    library's default: $ODC_TIMEOUT, checked by odcCommConfigResolve)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number)):
        raise _invalid(f"timeout must be a number of seconds, got {timeout!r}")
    if math.isnan(float(timeout)):
        raise _invalid("timeout must be a number of seconds, got nan")
    if not float(timeout) > 0:
        raise _invalid(
            f"timeout must be a positive number of seconds, float('inf') (no timeout), or "
            f"None (the default: $ODC_TIMEOUT, else 60 s); got {timeout!r}"
        )


class _View:
    """Owner of one view of a buffer: numpy keeps it as the array's base (torch holds it for the
    tensor's life), so the view keeps the buffer and its communicator alive, and the buffer
    counts its live views. `protocol` is __array_interface__ or __cuda_array_interface__."""

    def __init__(self, buffer: "Buffer", protocol: str, interface: dict):
        setattr(self, protocol, interface)
        self._buffer = buffer
        buffer._num_views += 1
        buffer._comm._num_views += 1

    def __del__(self) -> None:
        try:
            buffer = self._buffer
            buffer._num_views -= 1
            buffer._comm._num_views -= 1
            if buffer._comm._num_views == 0:
                buffer._comm._release_deferred()
        except Exception:  # interpreter shutdown: nothing sensible to report
            pass


class Buffer:
    """A symmetric buffer: `count` elements of `dtype` on every rank.

    Host communicators: `array` is this rank's shard as numpy. Device communicators: `tensor()`
    (torch) or `__cuda_array_interface__` (CuPy, Numba) view the shard without copying.
    """

    def __init__(
        self,
        comm: "Comm",
        handle: ctypes.c_void_p,
        local: int,
        count: int,
        dtype: str,
        accumulator: bool,
        name: Optional[str] = None,
    ):
        self._comm = comm
        self._handle = handle
        self._local = local
        self.count = count
        self.dtype = dtype
        self.accumulator = accumulator
        self.name = name
        self.device = comm.device
        self._num_views = 0  # live numpy / torch views (see the module docstring)

    def _host_view(self) -> np.ndarray:
        """A new numpy view of the shard whose base holds this buffer (raw bits for bfloat16)."""
        interface = {
            "shape": (self.count,),
            "typestr": "<f4" if self.dtype == "float32" else "<u2",
            "data": (self._local, False),
            "version": 3,
        }
        return np.asarray(_View(self, "__array_interface__", interface))

    @property
    def array(self) -> np.ndarray:
        """This rank's shard on a host communicator (bfloat16 as uint16 bits unless ml_dtypes).

        The array keeps this buffer and its communicator alive; free() refuses while it lives."""
        self._require_live()
        if self.device is not None:
            raise _invalid(
                "buffer.array is for host communicators; use buffer.tensor() or "
                "__cuda_array_interface__ for device buffers"
            )
        return self._host_view().view(_array_dtype(self.dtype))

    @property
    def __cuda_array_interface__(self) -> dict:
        """The device shard for CuPy, Numba and torch.as_tensor (bfloat16 as uint16 bits)."""
        if self.device is None:
            raise AttributeError("host buffers have no __cuda_array_interface__")
        self._require_live()
        return {
            "shape": (self.count,),
            "typestr": "<f4" if self.dtype == "float32" else "<u2",
            "data": (self._local, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self):
        """This rank's shard as a torch tensor sharing the buffer's memory (no copy)."""
        import torch

        self._require_live()
        if self.device is None:
            return torch.from_numpy(self._host_view()).view(_torch_dtype(torch, self.dtype))
        # torch holds the interface's owner for the tensor's life: a counted _View.
        owner = _View(self, "__cuda_array_interface__", self.__cuda_array_interface__)
        view = torch.as_tensor(owner, device=f"cuda:{self.device}")
        return view.view(_torch_dtype(torch, self.dtype))

    def free(self) -> None:
        """Collective: releases the buffer on every rank.

        Raises (before any communication) while views of it (`array`, `tensor()`) are alive."""
        self._require_live()
        if self._num_views > 0:
            raise InvalidUsage(
                f"rank {self._comm.rank}: free: {self._num_views} view(s) of this buffer "
                "(buffer.array / buffer.tensor()) are still alive; delete them first"
            )
        self._comm._call(_capi.lib.odcBufferFree, self._handle)
        self._handle = None

    def keep_sums(self) -> None:
        """Local, between minibatches, accumulators only: the next minibatch_begin keeps this
        rank's current sums instead of zeroing them, so that minibatch adds to them (once)."""
        self._require_live()
        self._comm._call(_capi.lib.odcAccumulatorKeepSums, self._handle)

    def _require_live(self) -> None:
        if self._handle is None or self._comm._handle is None:
            raise InvalidUsage("buffer used after free() or Comm.close()")


class Comm:
    """A communicator of `world_size` local processes that share `key` (see odc.launch), or that
    meet through `store` (a torch.distributed store, e.g. torchrun's, or any object with
    set/get/add; then no key is needed): the store is then the bootstrap (odcBootstrap_t), rank 0
    makes a random key for the shared memory that only this job learns, and a rank whose init
    fails marks itself failed in the store, so its peers fail naming it instead of waiting.
    Communicators on one store are created one at a time, in the same order on every rank:
    creations from several threads that overlap on one store fail (on every rank).

    timeout: seconds any wait on another rank may take before failing: positive, or
    float("inf") to wait forever; None (default): $ODC_TIMEOUT (a positive number or "inf"; other
    values are refused, naming it), else 60. A dead or silent peer raises odc.Error naming the rank
    and the operation.
    device: None for the host shared-memory transport, or this rank's CUDA device index for the
    CUDA transport (one process per GPU).
    transport: None (default: "shm" without a device; with one, $ODC_TRANSPORT if set, else
    "cuda"), or "shm", "cuda", "nvshmem" (NVSHMEM, one node or many; docs/multinode.md).
    deterministic: every owner adds contributions in a fixed order (sender rank, then push index),
    so sums are bitwise identical whatever the timing; costs world_size x count fp32 of extra
    memory per accumulator (4 bytes per full-gradient element) plus 4 MiB per communicator
    (docs/runtime.md). Default: the fastest exact scheme (CUDA: atomics; shm: streamed).
    staging_bytes: the streamed scheme's staging budget per rank (shm: pushes travel during the
    minibatch through a bounded ring per sender at each owner): the most memory it takes, whatever
    the model and world size. None (default): $ODC_STAGING_BYTES, else 256 MiB. Equal on every
    rank.
    ranks_per_node: consecutive ranks per node, for the node layout every rank agrees on at init
    (`topology`). None (default): $ODC_LOCAL_WORLD_SIZE, else torchrun's $LOCAL_WORLD_SIZE, else
    the transport's report (the host).
    node_cache_bytes: with more than one node, the node cache's budget per rank (published
    buffers' remote shards fetched once per node and minibatch); 0: off. None (default):
    $ODC_NODE_CACHE_BYTES, else 256 MiB. Equal on every rank.
    node_aggregation_bytes: streamed scheme with more than one node, the budget per rank of the
    relay rows of node-aggregated pushes (one node-summed slice per other node, sent at
    minibatch_end); 0: off. None (default): $ODC_NODE_AGGREGATION_BYTES, else 0. Equal on every
    rank. Both: docs/runtime.md "Node schemes".
    cuda_sms: CUDA transport, the SMs odc's data kernels size their grids for (fewer leave room
    for compute kernels beside gathers and pushes; more than the device has: all). None (default):
    $ODC_CUDA_SMS, else all.
    nvshmem_heap_bytes: NVSHMEM transport, the symmetric heap per GPU NVSHMEM reserves when this
    process's first NVSHMEM communicator starts it (fixed from then on), unless
    NVSHMEM_SYMMETRIC_SIZE is set. None (default): $ODC_NVSHMEM_HEAP_GIB, else 4 GiB;
    odc.nvshmem_heap.heap_need says what a model needs (docs/multinode.md, "Heap size").
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        key: Optional[str] = None,
        timeout: Optional[float] = None,
        device: Optional[int] = None,
        deterministic: bool = False,
        store: Any = None,
        transport: Optional[str] = None,
        staging_bytes: Optional[int] = None,
        ranks_per_node: Optional[int] = None,
        node_cache_bytes: Optional[int] = None,
        node_aggregation_bytes: Optional[int] = None,
        cuda_sms: Optional[int] = None,
        nvshmem_heap_bytes: Optional[int] = None,
    ):
        self._init_state()
        # Validate before calling C: ctypes truncates wide integers and C strings end at a NUL.
        world_size = _checked_int(world_size, "world_size", 1, _INT_MAX)
        rank = _checked_int(rank, "rank", -_INT_MAX - 1, _INT_MAX)  # C names a rank out of range
        device = _optional_int(device, "device", 0, _INT_MAX)
        staging_bytes = _optional_int(staging_bytes, "staging_bytes", 1, _COUNT_MAX)
        ranks_per_node = _optional_int(ranks_per_node, "ranks_per_node", 1, _INT_MAX)
        node_cache_bytes = _optional_int(node_cache_bytes, "node_cache_bytes", 0, _COUNT_MAX)
        node_aggregation_bytes = _optional_int(
            node_aggregation_bytes, "node_aggregation_bytes", 0, _COUNT_MAX
        )
        cuda_sms = _optional_int(cuda_sms, "cuda_sms", 1, _INT_MAX)
        nvshmem_heap_bytes = _optional_int(nvshmem_heap_bytes, "nvshmem_heap_bytes", 1, _COUNT_MAX)
        _check_transport(transport, device)
        _check_rendezvous(key, store)
        _check_timeout(timeout)
        config = _capi.new_comm_config()
        config.key = None if key is None else key.encode()  # the library copies it
        config.timeout_seconds = float(timeout) if timeout is not None else 0.0
        # Without a transport the library picks: shm without a device, else $ODC_TRANSPORT or cuda.
        config.transport = _TRANSPORTS[transport] if transport is not None else _capi.TRANSPORT_AUTO
        config.device = -1 if device is None else int(device)
        config.deterministic = int(bool(deterministic))
        config.staging_bytes = _bytes_or_environment(staging_bytes)
        config.ranks_per_node = 0 if ranks_per_node is None else int(ranks_per_node)
        config.node_cache_bytes = _bytes_or_environment(node_cache_bytes)
        config.node_aggregation_bytes = _bytes_or_environment(node_aggregation_bytes)
        config.cuda_sms = 0 if cuda_sms is None else int(cuda_sms)
        if nvshmem_heap_bytes is None:  # what size_heap chose for this process, if anything
            nvshmem_heap_bytes = nvshmem_heap.sized_heap_bytes()
        config.nvshmem_heap_bytes = _bytes_or_environment(nvshmem_heap_bytes)
        # What the library will use where the arguments leave it to the environment (one reader:
        # src/core/comm_config.cc); a bad $ODC_TIMEOUT or $ODC_TRANSPORT is refused here, by name.
        resolved = _capi.resolve_comm_config(config)
        if store is not None:
            from ._store_bootstrap import StoreBootstrap

            # Kept alive as long as the communicator: the library calls back into it on failure.
            self._bootstrap = StoreBootstrap(
                store, int(rank), int(world_size), resolved.timeout_seconds
            )
            config.bootstrap = ctypes.pointer(self._bootstrap.struct)
        self._handle = self._init_handle(rank, world_size, config)
        if resolved.transport == _capi.TRANSPORT_NVSHMEM:
            # Its heap is reserved now, at its size for good.
            nvshmem_heap.note_nvshmem_started(nvshmem_heap_bytes)
            self._nvshmem = True
        self.deterministic = bool(deterministic)
        self.device = None if device is None else int(device)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.key = key

    def _init_state(self) -> None:
        """The state every Comm starts with, before it owns a handle (__init__ and _adopt)."""
        self._handle = None
        self._deferred_handle = None
        self._nvshmem = False  # over NVSHMEM (odc.torch checks its heap against a model's need)
        self._num_views = 0
        self._bootstrap = None
        # The creating process: a forked child's copy of this object must never destroy it (its
        # finalizer would close the parent's rank in the shared control block).
        self._pid = os.getpid()
        self._close_lock = threading.Lock()

    def _init_handle(self, rank: int, world_size: int, config) -> ctypes.c_void_p:
        """odcCommInitConfig: the new communicator's handle, or the error that says why not (what
        a signal handler raised, what the store said, else the library's message)."""
        handle = ctypes.c_void_p()
        try:
            result = _capi.lib.odcCommInitConfig(
                ctypes.byref(handle), rank, world_size, ctypes.byref(config)
            )
        finally:
            if self._bootstrap is not None:
                self._bootstrap.init_done()
        if result == _capi.SUCCESS and self._bootstrap is not None and self._bootstrap.concurrent:
            # Another creation on this store began after this one's last round: this one may
            # have paired with the wrong communicator of another rank. Fail it (its peer fails
            # naming this rank and why), never use it.
            from ._store_bootstrap import CONCURRENT_INIT

            reason = f"rank {rank}: init: {CONCURRENT_INIT}"
            _capi.lib.odcCommAbort(handle, reason.encode()[:200])
            _capi.lib.odcCommDestroy(handle)
            raise InvalidUsage(reason)
        if result != _capi.SUCCESS and _capi.take_interrupt_pending():
            _capi.check_comm(result)  # raises what a signal handler raised (KeyboardInterrupt)
        if result != _capi.SUCCESS and self._bootstrap is not None and self._bootstrap.error:
            # The library only saw the callback's result code; say what the store said.
            message = _capi.lib.odcGetLastError().decode("utf-8", "replace")
            raise _capi.Error(f"{message}: {self._bootstrap.error}", result)
        _capi.check_comm(result)
        return handle

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Frees the communicator and its buffers (local; idempotent).

        While views of its buffers are alive, the communicator is closed for use at once but its
        memory is released only when the last view is gone (see the module docstring).
        Device communicators: collective (odcCommDestroy): the release first meets every peer's,
        bounded by the timeout, so that no peer's queued work still uses this rank's memory;
        close them in the same order on every rank.
        From another thread while a call is in flight: that call's wait on other ranks ends and it
        raises odc.Error (the communicator was destroyed); close() returns once it has.
        In a forked child (os.fork) it only forgets the handle: the communicator is the parent's."""
        with self._close_lock:
            handle, self._handle = self._handle, None
            if handle is None:
                return
            if os.getpid() != self._pid:
                return  # a forked child's copy: the parent's communicator stays as it is
            if self._num_views > 0:
                self._deferred_handle = handle
                return
        _capi.check_comm(_capi.lib.odcCommDestroy(handle))

    @property
    def closed(self) -> bool:
        """close() was called (every call on it raises odc.InvalidUsage since)."""
        return self._handle is None

    @property
    def release_pending(self) -> bool:
        """Closed, but its memory is still held because views of its buffers are alive (close()
        released it only when the last one is gone)."""
        return self._handle is None and self._deferred_handle is not None

    def _release_deferred(self) -> None:
        with self._close_lock:
            handle, self._deferred_handle = self._deferred_handle, None
        if handle is not None and os.getpid() == self._pid:
            _capi.lib.odcCommDestroy(handle)

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_close_lock", None) is not None:
                self.close()
        except Exception:  # interpreter shutdown: nothing sensible to report
            pass

    def _call(self, function, *args) -> None:
        if self._handle is None:
            raise InvalidUsage(f"rank {self.rank}: communicator used after close()")
        _capi.check_comm(function(self._handle, *args))

    # -- buffers ---------------------------------------------------------------------------
    def alloc(
        self,
        count: int,
        dtype: str = "float32",
        accumulator: bool = False,
        name: Optional[str] = None,
        published: bool = False,
    ) -> Buffer:
        """Collective: a symmetric buffer; every rank must pass the same arguments.

        name: an optional tag (1-256 printable ASCII characters) checked across ranks like the
        count: buffers of the same size allocated in a different order on different ranks then
        raise on every rank, naming both requests, instead of silently pairing up.
        published: owners rewrite their shards only between minibatches (after minibatch_end,
        before the next minibatch_begin), as odc.torch's parameters; gathers inside a minibatch
        may then be served from a copy fetched once at minibatch_begin (with more than one node:
        the node cache, once per node, $ODC_NODE_CACHE_BYTES). Leave it False for buffers
        rewritten inside a minibatch."""
        if accumulator and published:
            raise _invalid(
                f"rank {self.rank}: alloc: a buffer is either an accumulator or published, not both"
            )
        if name is not None:
            if not isinstance(name, str):
                raise _invalid(f"rank {self.rank}: alloc: name must be a string, got {name!r}")
            if not 1 <= len(name) <= _NAME_MAX or not all(" " <= c <= "~" for c in name):
                raise _invalid(
                    f"rank {self.rank}: alloc: name must be 1-{_NAME_MAX} printable ASCII "
                    f"characters, got {name!r}"
                )
        if dtype not in _DTYPES:
            raise _invalid(
                f"rank {self.rank}: alloc: unknown dtype {dtype!r}: "
                "expected 'float32' or 'bfloat16'"
            )
        if (
            isinstance(count, bool)
            or not isinstance(count, (int, np.integer))
            or not 0 <= count <= _COUNT_MAX
        ):
            raise _invalid(
                f"rank {self.rank}: alloc: count must be an integer in [0, {_COUNT_MAX}], "
                f"got {count!r}"
            )
        handle = ctypes.c_void_p()
        local = ctypes.c_void_p()
        kind = _BUFFER_ACCUMULATOR if accumulator else (_BUFFER_PUBLISHED if published else 0)
        self._call(
            _capi.lib.odcBufferAllocKind,
            int(count),
            _DTYPES[dtype],
            kind,
            None if name is None else name.encode("ascii"),
            ctypes.byref(handle),
            ctypes.byref(local),
        )
        return Buffer(self, handle, local.value, int(count), dtype, bool(accumulator), name)

    # -- operations ------------------------------------------------------------------------
    def gather(self, out: Any, buffer: Buffer, stream: Any = None) -> None:
        """out[r*count:(r+1)*count] = rank r's shard, for every rank r. `out` holds the buffer's
        dtype, or bfloat16 for a float32 buffer (host: ml_dtypes bfloat16 or its uint16 bits):
        then each element is rounded to nearest even as it is pulled, with no float32 copy."""
        buffer._require_live()
        if self.device is None:
            if (
                not isinstance(out, np.ndarray)
                or not out.flags.c_contiguous
                or not out.flags.writeable
            ):
                raise _invalid(
                    f"rank {self.rank}: gather: out must be a writeable C-contiguous " "numpy array"
                )
            if out.dtype == np.float32:
                kind = "float32"
            else:
                kind = "bfloat16" if _is_bf16_bits(out) else str(out.dtype)
            pointer, count = out.ctypes.data, out.size
        else:
            pointer, count, kind = _device_array(out, f"rank {self.rank}: gather: out")
        stream_handle = _stream_handle(stream, self.device)
        if kind == buffer.dtype:
            self._call(_capi.lib.odcGather, pointer, count, buffer._handle, stream_handle)
        elif kind == "bfloat16" and buffer.dtype == "float32":
            self._call(
                _capi.lib.odcGatherAs,
                pointer,
                count,
                _DTYPES[kind],
                buffer._handle,
                stream_handle,
            )
        else:
            raise _invalid(
                f"rank {self.rank}: gather: out holds {kind}, the buffer holds {buffer.dtype} "
                "(out has the buffer's dtype, or bfloat16 for a float32 buffer)"
            )

    def scatter_accumulate(
        self, src: Any, accumulator: Buffer, src_dtype: Optional[str] = None, stream: Any = None
    ) -> None:
        """Adds src[r*count:(r+1)*count] into rank r's accumulator, for every rank r (fp32).

        Host: src is a float32 numpy array, or bfloat16 (ml_dtypes) or its uint16 bits with
        src_dtype="bfloat16". GPU: a float32 or bfloat16 CUDA tensor (or array interface).
        """
        accumulator._require_live()
        if src_dtype is not None and src_dtype not in _DTYPES:
            raise _invalid(
                f"rank {self.rank}: scatter_accumulate: unknown src_dtype " f"{src_dtype!r}"
            )
        if self.device is None:
            if not isinstance(src, np.ndarray):
                raise _invalid(f"rank {self.rank}: scatter_accumulate: src must be a numpy array")
            if src.dtype == np.float32:
                kind = "float32"
            elif _is_bf16_bits(src) and (src_dtype == "bfloat16" or src.dtype != np.uint16):
                kind = "bfloat16"
            else:
                kind = str(src.dtype)
            src = np.ascontiguousarray(src)
            pointer, count = src.ctypes.data, src.size
        else:
            pointer, count, kind = _device_array(src, f"rank {self.rank}: scatter_accumulate: src")
        if src_dtype is not None and kind != src_dtype:
            raise _invalid(
                f"rank {self.rank}: scatter_accumulate: src holds {kind}, not " f"{src_dtype}"
            )
        if kind not in _DTYPES:
            raise _invalid(
                f"rank {self.rank}: scatter_accumulate: src has dtype {kind}; expected "
                "float32 or bfloat16 (uint16 bits with src_dtype='bfloat16')"
            )
        self._call(
            _capi.lib.odcScatterAccumulate,
            pointer,
            count,
            _DTYPES[kind],
            accumulator._handle,
            _stream_handle(stream, self.device),
        )

    def minibatch_begin(self, stream: Any = None) -> None:
        """Collective: zeroes this rank's accumulators, then waits for every rank."""
        self._call(_capi.lib.odcMinibatchBegin, _stream_handle(stream, self.device))

    def minibatch_end(self, stream: Any = None) -> None:
        """Collective: every rank's contributions are applied everywhere when it completes
        (on return for host communicators; in stream order on GPUs)."""
        self._call(_capi.lib.odcMinibatchEnd, _stream_handle(stream, self.device))

    def barrier(self, stream: Any = None) -> None:
        """Collective: completes when every rank has called it."""
        self._call(_capi.lib.odcBarrier, _stream_handle(stream, self.device))

    # -- the work board (work stealing inside a minibatch) -----------------------------------
    def work_board_open(
        self, counts: Sequence[int], costs: Optional[Sequence[Sequence[float]]] = None
    ) -> None:
        """Collective per minibatch (every rank, after minibatch_begin, the same plan;
        odcWorkBoardOpen): opens this minibatch's work board. `counts[r]`: rank r's microbatches
        (0..65535), one entry per rank; `costs[r][i]`: the predicted cost of rank r's microbatch
        i (finite, >= 0), None: all 1.0. Then work_board_take() hands out microbatches, each
        exactly once across the ranks. The first open allocates 8 bytes per rank (meeting every
        rank). Raises InvalidUsage outside a minibatch, a second time in one, and in
        deterministic mode; InvalidArgument for a bad plan."""
        if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
            raise _invalid(f"counts must be a sequence of ints (one per rank), got {counts!r}")
        checked = [_checked_int(c, f"counts[{r}]", 0, 65535) for r, c in enumerate(counts)]
        if len(checked) != self.world_size:
            raise _invalid(
                f"counts has {len(checked)} entries but the communicator has {self.world_size} "
                "ranks: give one count of microbatches per rank"
            )
        count_array = (ctypes.c_int32 * max(len(checked), 1))(*checked)
        cost_array = None
        if costs is not None:
            if isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__"):
                raise _invalid(f"costs must be one sequence of floats per rank, got {costs!r}")
            if len(costs) != len(checked):
                raise _invalid(f"costs has {len(costs)} queues, counts has {len(checked)}")
            flat: List[float] = []
            for r, (queue, count) in enumerate(zip(costs, checked)):
                values = [float(v) for v in queue]
                if len(values) != count:
                    raise _invalid(f"costs[{r}] has {len(values)} values, counts[{r}] is {count}")
                flat.extend(values)
            cost_array = (ctypes.c_double * max(len(flat), 1))(*flat)
        self._call(_capi.lib.odcWorkBoardOpen, len(checked), count_array, cost_array)

    def work_board_take(self) -> Optional[Tuple[int, int]]:
        """Local (odcWorkBoardTake): claims one microbatch of this minibatch's board: (queue
        rank, index in that queue), this rank's own front first, then the tail of the queue with
        the most predicted cost left; None when none is left for this rank. Raises InvalidUsage
        before work_board_open; RemoteError naming a dead or failed peer."""
        queue, index = ctypes.c_int32(), ctypes.c_int32()
        self._call(_capi.lib.odcWorkBoardTake, ctypes.byref(queue), ctypes.byref(index))
        return None if queue.value < 0 else (queue.value, index.value)

    def work_board_stats(self) -> dict:
        """Microbatches this rank took from its own queue (`own`) and from other ranks' queues
        (`stolen`) in the minibatch whose board it opened last, and since the communicator was
        made (`own_total`, `stolen_total`)."""
        values = [ctypes.c_int64() for _ in range(4)]
        self._call(_capi.lib.odcWorkBoardStats, *(ctypes.byref(v) for v in values))
        own, stolen, own_total, stolen_total = (v.value for v in values)
        return {"own": own, "stolen": stolen, "own_total": own_total, "stolen_total": stolen_total}

    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Comm"]:
        """Collective over this communicator (odcCommSplit; every rank, same order; between
        minibatches or inside one): the ranks passing the same `color` (an int >= 0) form a
        sub-communicator, returned to each of them as a new `odc.Comm` of those ranks only, ranked
        by `key` (default: this rank), then by rank here; `color=None` (or negative) joins none
        and returns None. A sub-communicator is used and closed like any `Comm`: its buffers exist
        on its members only (a gather reads k shards for k members), its minibatches and barriers
        meet only its members and run independently of this communicator's (e.g. inside one of
        its minibatches), with this communicator's transport, device, scheme, budgets and timeout.
        Either may be closed first (device communicators: close sub-communicators in the same
        order on their members). Errors start "split colour C, parent ranks a, b, ...: rank R"
        (R counts members from 0); a member that dies or fails fails its peers naming it; a
        failure of this communicator on this rank (a fault, abort()) fails its sub-communicators
        here too, whose peers then name this rank. shm and cuda transports; nvshmem raises
        (not supported). docs/runtime.md, "Sub-communicators"."""
        color = -1 if color is None else _checked_int(color, "color", -_INT_MAX - 1, _INT_MAX)
        key = self.rank if key is None else _checked_int(key, "key", -_INT_MAX - 1, _INT_MAX)
        handle = ctypes.c_void_p()
        self._call(_capi.lib.odcCommSplit, color, key, ctypes.byref(handle))
        if not handle.value:
            return None
        return Comm._adopt(handle, self)

    @classmethod
    def _adopt(cls, handle: ctypes.c_void_p, parent: "Comm") -> "Comm":
        """A Comm owning `handle`, a sub-communicator split from `parent` (no __init__: nothing
        to meet through; its transport met its members)."""
        comm = cls.__new__(cls)
        comm._init_state()
        rank, world_size = ctypes.c_int(), ctypes.c_int()
        try:
            _capi.check_comm(_capi.lib.odcCommRank(handle, ctypes.byref(rank)))
            _capi.check_comm(_capi.lib.odcCommWorldSize(handle, ctypes.byref(world_size)))
        except BaseException:
            _capi.lib.odcCommDestroy(handle)
            raise
        comm._handle = handle
        comm.deterministic = parent.deterministic
        comm.device = parent.device
        comm._nvshmem = parent._nvshmem
        comm.rank = rank.value
        comm.world_size = world_size.value
        comm.key = None
        return comm

    def memory_bytes(self) -> dict:
        """Symmetric memory this communicator holds on this rank now, in bytes: `buffers` (the
        shards of every live buffer), `scheme` (what the accumulation scheme adds: the
        streamed scheme's staging rings, at most `staging_bytes`; the deterministic scheme's
        pending buffers and scratch; 0 with CUDA's remote adds) and `node_cache` (with more than
        one node: other nodes' published shards fetched for this node each minibatch, at most
        $ODC_NODE_CACHE_BYTES, default 256 MiB; 0 on one node)."""
        buffers, scheme, cache = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        self._call(_capi.lib.odcCommGetMemory, ctypes.byref(buffers), ctypes.byref(scheme))
        self._call(_capi.lib.odcCommGetNodeCacheBytes, ctypes.byref(cache))
        return {"buffers": buffers.value, "scheme": scheme.value, "node_cache": cache.value}

    def stream_stats(self) -> dict:
        """The streamed scheme's flow control on this rank so far: `chunks_sent` (chunks put into
        owners' staging rings) and `credit_waits` (pushes that found a ring full and waited for
        the owner's next odc call). Both 0 under the other schemes."""
        sent, waits = ctypes.c_uint64(), ctypes.c_uint64()
        self._call(_capi.lib.odcCommGetStreamStats, ctypes.byref(sent), ctypes.byref(waits))
        return {"chunks_sent": sent.value, "credit_waits": waits.value}

    def node_traffic(self) -> dict:
        """Bytes of this rank's streamed chunks put into the rings of ranks on other nodes so far:
        `during_minibatches` (pushes, which overlap backward) and `in_minibatch_end` (what the
        tail waits for: the relay rows of node-aggregated pushes, all forwarded there). Both 0
        with one node and under the other schemes."""
        during, at_end = ctypes.c_uint64(), ctypes.c_uint64()
        self._call(_capi.lib.odcCommGetNodeTraffic, ctypes.byref(during), ctypes.byref(at_end))
        return {"during_minibatches": during.value, "in_minibatch_end": at_end.value}

    @property
    def over_nvshmem(self) -> bool:
        """Whether this communicator moves bytes over NVSHMEM (made with transport="nvshmem", or
        on a device with ODC_TRANSPORT=nvshmem; a split inherits its parent's): its buffers then
        live in NVSHMEM's symmetric heap, whose size is fixed once the first such communicator
        starts, so a caller that allocates for a model checks the model's need first (OdcFSDP
        does, docs/runtime.md)."""
        return self._nvshmem

    @property
    def topology(self) -> List[int]:
        """The node of every rank (a list of world_size ints, nodes numbered from 0 in order of
        their lowest rank), as every rank agreed at init: from `ranks_per_node`, else
        $ODC_LOCAL_WORLD_SIZE, else $LOCAL_WORLD_SIZE, else the transport's report."""
        node_of = (ctypes.c_int * self.world_size)()
        self._call(_capi.lib.odcCommGetTopology, None, node_of)
        return list(node_of)

    def poll_error(self) -> None:
        """Local, never blocks: raises odc.Error when device work of this communicator failed
        (a wait on another rank timed out, ranks met in different collectives); the
        communicator is failed from then on. GPU operations return before they run: to know
        that a minibatch's sums are complete, synchronize with its minibatch_end (e.g. an event
        recorded after it) first, then call this. Host communicators raise from the failing call
        itself; here they raise only their earlier failure."""
        self._call(_capi.lib.odcCommPollError)

    def abort(self, reason: str = "") -> None:
        """Local, never blocks: fails this communicator on purpose (e.g. an exception inside a
        minibatch). Every later call on this rank raises it; peers waiting on this rank raise
        odc.Error naming this rank and `reason` (its first 200 bytes) instead of waiting out their
        timeout (host communicators and the CUDA transport's device barriers at once; NVSHMEM's
        device waits at their timeout, naming this rank). A communicator cannot be revived:
        close it and build a new one. Keeps an earlier
        failure; a no-op after close()."""
        if self._handle is None:
            return
        text = str(reason).encode("ascii", "backslashreplace")[:200]
        _capi.check_comm(_capi.lib.odcCommAbort(self._handle, text))
