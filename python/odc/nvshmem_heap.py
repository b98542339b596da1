"""NVSHMEM's symmetric heap sized to what odc will hold (docs/multinode.md, "Heap size").

NVSHMEM reserves its heap once per process, at the first NVSHMEM communicator, at
NVSHMEM_SYMMETRIC_SIZE bytes per GPU, which odc sets from the communicator's nvshmem_heap_bytes,
else ODC_NVSHMEM_HEAP_GIB (default 4 GiB; src/core/comm_config.cc). This module asks the library
what odc puts there (`heap_need`: odcMemoryNeed, plain numbers: no torch, no GPU) and holds the
one place that picks the size for a known need (`size_heap`), which odc.Comm then passes as an
argument. Invariants: a size the user set is never overridden; the environment is never written;
a heap already reserved is never resized, so a larger need raises, naming the size and the knob.
odc.torch computes the need from an FSDP2 model (odc.torch.size_nvshmem_heap).
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

from .errors import InvalidArgument, InvalidUsage

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_HEAP_BYTES = 4 * GIB  # ODC_NVSHMEM_HEAP_GIB's default (src/core/comm_config.h)

HEAP_KNOB = "ODC_NVSHMEM_HEAP_GIB"
NVSHMEM_KNOB = "NVSHMEM_SYMMETRIC_SIZE"


def parse_nvshmem_size(text: str) -> int:
    """NVSHMEM_SYMMETRIC_SIZE as NVSHMEM reads it: a number with an optional k, m, g or t suffix
    (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)[bB]?\s*", text)
    if match is None:
        raise InvalidArgument(f"{NVSHMEM_KNOB}='{text}' is not a size (e.g. 4294967296 or 4G)")
    power = "kmgt".find(match.group(2).lower()) + 1 if match.group(2) else 0
    return int(float(match.group(1)) * 1024**power)


@dataclass(frozen=True)
class HeapNeed:
    """Bytes per rank odc puts on NVSHMEM's heap, by kind (docs/multinode.md, "Heap size"), as the
    library counts them (odcMemoryNeed)."""

    published: int  # every non-accumulator buffer's shard (odc.torch: the parameter shards)
    accumulators: int  # 4 bytes per accumulator shard element (fp32 sums)
    staging: int  # the streamed scheme's staging rings: the staging budget, once per communicator
    node_cache: int  # other nodes' published shards, at most the node cache budget
    aggregation: int  # relay rows of node-aggregated pushes, at most their budget
    deterministic: int  # the pulled scheme's pending sums, 4 S N per accumulator (+ scratch)
    heap_bytes: int  # the heap to ask for: the sum plus the library's margin (odcMemoryNeed_t)

    @property
    def subtotal(self) -> int:
        return (
            self.published
            + self.accumulators
            + self.staging
            + self.node_cache
            + self.aggregation
            + self.deterministic
        )

    @property
    def margin(self) -> int:
        return self.total - self.subtotal

    @property
    def total(self) -> int:
        """The heap to ask for: the sum, plus 5% of it and 64 MiB, rounded up to 64 MiB."""
        return self.heap_bytes

    @property
    def gib(self) -> float:
        return self.total / GIB

    def describe(self) -> str:
        parts = [
            ("shards", self.published),
            ("accumulators", self.accumulators),
            ("staging", self.staging),
            ("node cache", self.node_cache),
            ("aggregation", self.aggregation),
            ("deterministic", self.deterministic),
            ("margin", self.margin),
        ]
        listed = ", ".join(f"{name} {value / GIB:.2f}" for name, value in parts if value)
        return f"{self.gib:.2f} GiB ({listed} GiB)"


def heap_need(
    published_bytes: int,
    accumulator_elements: int,
    world_size: int,
    ranks_per_node: Optional[int] = None,
    *,
    deterministic: bool = False,
    staging_bytes: Optional[int] = None,
    node_cache_bytes: Optional[int] = None,
    node_aggregation_bytes: Optional[int] = None,
) -> HeapNeed:
    """What one communicator of `world_size` ranks in nodes of `ranks_per_node` consecutive ranks
    puts on each rank's heap for buffers of these sizes per rank: `published_bytes` (the shards
    of every published / plain buffer) and `accumulator_elements` (fp32 elements of every
    accumulator's shard). The library counts it (odcMemoryNeed), with the budgets it would use:
    those not given come from the environment as odc.Comm reads them (ODC_STAGING_BYTES,
    ODC_NODE_CACHE_BYTES, ODC_NODE_AGGREGATION_BYTES), else the defaults. ranks_per_node None:
    ODC_LOCAL_WORLD_SIZE, else LOCAL_WORLD_SIZE, else one node per rank (the most nodes: every
    node scheme counted). The node schemes are upper bounds: the core caches and relays buffer by
    buffer while its budget lasts, so it may hold less."""
    from . import _capi

    if world_size < 1 or published_bytes < 0 or accumulator_elements < 0:
        raise InvalidArgument("heap_need: world_size must be positive and sizes non-negative")
    unset = _capi.BYTES_FROM_ENVIRONMENT
    config = _capi.new_comm_config()
    config.deterministic = int(bool(deterministic))
    config.ranks_per_node = 0 if ranks_per_node is None else int(ranks_per_node)
    config.staging_bytes = unset if staging_bytes is None else int(staging_bytes)
    config.node_cache_bytes = unset if node_cache_bytes is None else int(node_cache_bytes)
    config.node_aggregation_bytes = (
        unset if node_aggregation_bytes is None else int(node_aggregation_bytes)
    )
    need = _capi.MemoryNeed()
    _capi.check(
        _capi.lib.odcMemoryNeed(
            ctypes.byref(config),
            int(world_size),
            int(published_bytes),
            int(accumulator_elements),
            ctypes.byref(need),
        )
    )
    return HeapNeed(**{name: getattr(need, name) for name, _ in _capi.MemoryNeed._fields_})


# -- the process's heap ----------------------------------------------------------------------
# The heap NVSHMEM reserved in this process (bytes), once an NVSHMEM communicator started it.
_reserved_bytes: Optional[int] = None
# The heap size_heap chose for this process (bytes), which odc.Comm passes to the first NVSHMEM
# communicator (nvshmem_heap_bytes) where the user set no size: never written to the environment.
_sized_bytes: Optional[int] = None


def configured_heap(environ: Optional[Mapping[str, str]] = None):
    """(bytes, source): the heap NVSHMEM would reserve now. source is the knob that says so
    (NVSHMEM_SYMMETRIC_SIZE, then ODC_NVSHMEM_HEAP_GIB), "odc" where size_heap chose it, or
    "default"."""
    environ = os.environ if environ is None else environ
    if environ.get(NVSHMEM_KNOB):
        return parse_nvshmem_size(environ[NVSHMEM_KNOB]), NVSHMEM_KNOB
    text = environ.get(HEAP_KNOB, "")
    if text:
        try:
            gib = float(text)
        except ValueError:
            gib = DEFAULT_HEAP_BYTES / GIB  # the core ignores a value that is not a number
        return int(gib * GIB), HEAP_KNOB
    if _sized_bytes is not None:
        return _sized_bytes, "odc"
    return DEFAULT_HEAP_BYTES, "default"


def sized_heap_bytes() -> Optional[int]:
    """The heap size_heap chose for this process, where the user set none (what odc.Comm passes
    as nvshmem_heap_bytes when it is not given), else None."""
    heap, source = configured_heap()
    return heap if source == "odc" else None


def note_nvshmem_started(heap_bytes: Optional[int] = None) -> None:
    """Called by odc.Comm when an NVSHMEM communicator was made (with `heap_bytes`, the heap it
    asked for, None: the configured one): from then on this process's heap is what it was
    configured as (NVSHMEM reserves it once; NVSHMEM_SYMMETRIC_SIZE wins). A size this module
    cannot read (NVSHMEM parsed it, or the communicator would not exist) leaves the heap unknown:
    no check."""
    global _reserved_bytes
    if _reserved_bytes is None:
        try:
            heap, source = configured_heap()
            _reserved_bytes = heap if heap_bytes is None or source == NVSHMEM_KNOB else heap_bytes
        except InvalidArgument:
            pass


def reserved_heap_bytes() -> Optional[int]:
    """The heap this process's NVSHMEM reserved, or None where no NVSHMEM communicator was made."""
    return _reserved_bytes


def _too_small(need: HeapNeed, heap: int, what: str) -> str:
    gib = math.ceil(need.total / GIB * 16) / 16  # a round value the user can copy
    return (
        f"odc needs {need.describe()} of NVSHMEM symmetric heap per GPU, and {what} "
        f"{heap / GIB:.2f} GiB: set {HEAP_KNOB}={gib:g} (or {NVSHMEM_KNOB}={need.total}) before "
        'the first NVSHMEM communicator of the process (docs/multinode.md, "Heap size")'
    )


def check_reserved(need: HeapNeed) -> None:
    """Where this process's NVSHMEM already reserved its heap (it cannot grow): raises
    InvalidUsage when the heap is smaller than what odc will certainly allocate (the shards, the
    accumulators, the deterministic sums), and warns when it is smaller than that plus the
    budgets, which are upper bounds (the staging rings of a small world and the node schemes may
    take less; a margin is not needed). Nothing before NVSHMEM started."""
    if _reserved_bytes is None:
        return
    certain = need.published + need.accumulators + need.deterministic
    what = "this process's NVSHMEM reserved its heap at"
    if certain > _reserved_bytes:
        raise InvalidUsage(_too_small(need, _reserved_bytes, what))
    if need.subtotal > _reserved_bytes:
        warnings.warn(_too_small(need, _reserved_bytes, what) + "; going on: the budgets may fit")


@dataclass(frozen=True)
class HeapSizing:
    """What size_heap decided: the need, what it did (`action`) and the heap NVSHMEM reserves (or
    reserved) in this process, in bytes."""

    need: HeapNeed
    action: str
    heap_bytes: int

    def describe(self) -> str:
        said = {
            "sized": "sized by odc to the model",
            "kept": "odc's earlier size covers it",
            "user": "the user's setting",
            "reserved": "already reserved by NVSHMEM",
        }[self.action]
        return f"NVSHMEM heap {self.heap_bytes / GIB:.2f} GiB per GPU ({said}); odc needs {self.need.describe()}"


def size_heap(need: HeapNeed, environ: Optional[Mapping[str, str]] = None) -> HeapSizing:
    """Before the first NVSHMEM communicator of the process: chooses need.total as the heap the
    process's first NVSHMEM odc.Comm asks for (its nvshmem_heap_bytes; the environment is left as
    it is) unless the user set NVSHMEM_SYMMETRIC_SIZE or ODC_NVSHMEM_HEAP_GIB (then only warns
    when theirs is smaller). Its `action`: "sized" (chosen now, or raised to a larger need),
    "kept" (an earlier size_heap's choice covers it), "user" (the user's setting stands) or
    "reserved" (NVSHMEM already started with a heap that fits). Raises InvalidUsage where NVSHMEM
    already reserved a smaller heap."""
    global _sized_bytes
    environ = os.environ if environ is None else environ
    if _reserved_bytes is not None and environ is os.environ:
        check_reserved(need)
        return HeapSizing(need, "reserved", _reserved_bytes)
    heap, source = configured_heap(environ)
    if source in (NVSHMEM_KNOB, HEAP_KNOB):
        if need.total > heap:
            warnings.warn(_too_small(need, heap, f"{source} gives"), stacklevel=2)
        return HeapSizing(need, "user", heap)
    if source == "odc" and heap >= need.total:
        return HeapSizing(need, "kept", heap)
    _sized_bytes = need.total
    return HeapSizing(need, "sized", need.total)
