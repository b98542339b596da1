"""NVSHMEM's symmetric heap sized to what odc will hold (docs/multinode.md, "Heap size").

NVSHMEM reserves its heap once per process, at the first NVSHMEM communicator, at
NVSHMEM_SYMMETRIC_SIZE bytes per GPU, which odc sets from ODC_NVSHMEM_HEAP_GIB (default 4 GiB;
src/transport/nvshmem/nvshmem_process.cc). This module holds the arithmetic of what odc puts
there (`HeapNeed`, plain numbers: no torch, no GPU) and the one place that picks the size for a
known need (`size_heap`). Invariants: a size the user set is never overridden; a heap already
reserved is never resized, so a larger need raises, naming the size and the knob.
odc.torch computes the need from an FSDP2 model (odc.torch.size_nvshmem_heap).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import MutableMapping, Optional

from .errors import InvalidArgument, InvalidUsage

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_HEAP_BYTES = 4 * GIB  # ODC_NVSHMEM_HEAP_GIB's default (nvshmem_process.cc)
DEFAULT_STAGING_BYTES = 256 * MIB  # kDefaultStagingBytes (src/core/streamed_staging.h)
DEFAULT_NODE_CACHE_BYTES = 256 * MIB  # kDefaultNodeCacheBytes (src/core/node_gather_cache.h)
DETERMINISTIC_FIXED_BYTES = 4 * MIB  # the pulled scheme's scratch per communicator (runtime.md)
# The margin on top of the sum: odc's signals (16 N bytes) and control words, NVSHMEM's
# allocation alignment, and fragmentation where buffers are freed and made again (a changed set
# of trainable parameters reallocates accumulators). 5% + 64 MiB, rounded up to 64 MiB.
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 64 * MIB
ROUND_BYTES = 64 * MIB

HEAP_KNOB = "ODC_NVSHMEM_HEAP_GIB"
NVSHMEM_KNOB = "NVSHMEM_SYMMETRIC_SIZE"


def parse_bytes(text: str, knob: str) -> int:
    """A byte count as odc's knobs take it (parse_count, src/common/env.h): ASCII digits (no
    spaces, signs or other scripts' digits; "00" is 0), optionally followed by K, M or G (KiB,
    MiB, GiB), below 2^64. Anything else raises InvalidArgument naming the knob."""
    match = re.fullmatch(r"([0-9]+)([kKmMgG]?)", text)
    value = None
    if match is not None:
        value = int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]
    if value is None or value >= 2**64:
        raise InvalidArgument(
            f"{knob}='{text}' is not a number of bytes: digits, optionally followed by K, M or G, "
            "below 2^64 (e.g. 0, 268435456 or 256M)"
        )
    return value


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
    """Bytes per rank odc puts on NVSHMEM's heap, by kind (docs/multinode.md, "Heap size")."""

    published: int  # every non-accumulator buffer's shard (odc.torch: the parameter shards)
    accumulators: int  # 4 bytes per accumulator shard element (fp32 sums)
    staging: int  # the streamed scheme's staging rings: the staging budget, once per communicator
    node_cache: int  # other nodes' published shards, at most the node cache budget
    aggregation: int  # relay rows of node-aggregated pushes, at most their budget
    deterministic: int  # the pulled scheme's pending sums, 4 S N per accumulator (+ scratch)

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
        """The heap to ask for: the sum, plus MARGIN_FRACTION of it and MARGIN_BYTES, rounded up to
        ROUND_BYTES."""
        raw = self.subtotal + math.ceil(self.subtotal * MARGIN_FRACTION) + MARGIN_BYTES
        return -(-raw // ROUND_BYTES) * ROUND_BYTES

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


def _budget(value: Optional[int], environ, knob: str, fallback: int) -> int:
    if value is not None:
        return int(value)
    text = environ.get(knob, "")
    return fallback if text == "" else parse_bytes(text, knob)


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
    environ: Optional[MutableMapping[str, str]] = None,
) -> HeapNeed:
    """What one communicator of `world_size` ranks in nodes of `ranks_per_node` consecutive ranks
    puts on each rank's heap for buffers of these sizes per rank: `published_bytes` (the shards
    of every published / plain buffer) and `accumulator_elements` (fp32 elements of every
    accumulator's shard). Budgets not given come from the environment as the core reads them
    (ODC_STAGING_BYTES, ODC_NODE_CACHE_BYTES, ODC_NODE_AGGREGATION_BYTES), else the core's
    defaults. ranks_per_node None: ODC_LOCAL_WORLD_SIZE, else LOCAL_WORLD_SIZE, else one node per
    rank (the most nodes: every node scheme counted). The node schemes are upper bounds: the core
    caches and relays buffer by buffer while its budget lasts, so it may hold less."""
    environ = os.environ if environ is None else environ
    if world_size < 1 or published_bytes < 0 or accumulator_elements < 0:
        raise InvalidArgument("heap_need: world_size must be positive and sizes non-negative")
    if ranks_per_node is None:
        text = environ.get("ODC_LOCAL_WORLD_SIZE") or environ.get("LOCAL_WORLD_SIZE") or "1"
        ranks_per_node = int(text) if text.isdigit() and int(text) > 0 else 1
    ranks_per_node = min(ranks_per_node, world_size)
    num_nodes = world_size // ranks_per_node if world_size % ranks_per_node == 0 else world_size
    accumulator_bytes = 4 * accumulator_elements
    staging = _budget(staging_bytes, environ, "ODC_STAGING_BYTES", DEFAULT_STAGING_BYTES)
    node_cache = aggregation = 0
    if num_nodes > 1:
        # Rows: the most remote owners one rank fetches (or relays for), nodes - 1 with equal
        # nodes (src/core/topology.h, NodeRoutes::max_rows).
        rows = num_nodes - 1
        cache = _budget(node_cache_bytes, environ, "ODC_NODE_CACHE_BYTES", DEFAULT_NODE_CACHE_BYTES)
        node_cache = min(cache, rows * published_bytes)
        if ranks_per_node > 1:  # aggregation pays only with several ranks per node (core)
            relay = _budget(node_aggregation_bytes, environ, "ODC_NODE_AGGREGATION_BYTES", 0)
            aggregation = min(relay, rows * accumulator_bytes)
    pending = accumulator_bytes * world_size + DETERMINISTIC_FIXED_BYTES if deterministic else 0
    if deterministic:  # the pulled scheme: no staging rings, so no relay rows either (core)
        staging = aggregation = 0
    return HeapNeed(
        published=published_bytes,
        accumulators=accumulator_bytes,
        staging=staging,
        node_cache=node_cache,
        aggregation=aggregation,
        deterministic=pending,
    )


# -- the process's heap ----------------------------------------------------------------------
# The heap NVSHMEM reserved in this process (bytes), once an NVSHMEM communicator started it.
_reserved_bytes: Optional[int] = None
# The ODC_NVSHMEM_HEAP_GIB value size_heap set (so a later, larger need before NVSHMEM starts may
# raise it: a value odc set is not the user's).
_set_by_odc: Optional[str] = None


def configured_heap(environ: Optional[MutableMapping[str, str]] = None):
    """(bytes, source): the heap NVSHMEM would reserve now. source is the knob that says so
    (NVSHMEM_SYMMETRIC_SIZE, then ODC_NVSHMEM_HEAP_GIB), "odc" where size_heap set it, or
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
        return int(gib * GIB), ("odc" if text == _set_by_odc else HEAP_KNOB)
    return DEFAULT_HEAP_BYTES, "default"


def note_nvshmem_started() -> None:
    """Called by odc.Comm when an NVSHMEM communicator was made: from then on this process's heap
    is what it was configured as (NVSHMEM reserves it once). A size this module cannot read
    (NVSHMEM parsed it, or the communicator would not exist) leaves the heap unknown: no check."""
    global _reserved_bytes
    if _reserved_bytes is None:
        try:
            _reserved_bytes = configured_heap()[0]
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


def size_heap(need: HeapNeed, environ: Optional[MutableMapping[str, str]] = None) -> HeapSizing:
    """Before the first NVSHMEM communicator of the process: sets ODC_NVSHMEM_HEAP_GIB to
    need.total unless the user set NVSHMEM_SYMMETRIC_SIZE or ODC_NVSHMEM_HEAP_GIB (then only warns
    when theirs is smaller). Its `action`: "sized" (set now, or raised to a larger need), "kept"
    (an earlier size_heap's value covers it), "user" (the user's setting stands) or "reserved"
    (NVSHMEM already started with a heap that fits). Raises InvalidUsage where NVSHMEM already
    reserved a smaller heap."""
    global _set_by_odc
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
    _set_by_odc = repr(need.total / GIB)  # exact: a multiple of 64 MiB over a power of two
    environ[HEAP_KNOB] = _set_by_odc
    return HeapSizing(need, "sized", need.total)
