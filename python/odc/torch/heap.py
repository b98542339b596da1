"""NVSHMEM's heap sized to an FSDP2 model: what OdcFSDP will allocate for it (its groups' published
shards and fp32 accumulators, as _group.GroupState allocates them) plus the communicator's budgets
(odc.nvshmem_heap.heap_need). Call size_nvshmem_heap before the first NVSHMEM communicator of the
process (comm_from_process_group(model=...) does); OdcFSDP checks the same need against a heap
NVSHMEM already reserved, so a model that cannot fit fails before allocating, naming the knob."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from .. import nvshmem_heap
from . import _fsdp2_internals as internals


def layouts_need(
    layouts: Iterable[internals.GroupLayout],
    world_size: int,
    ranks_per_node: Optional[int] = None,
    *,
    deterministic: bool = False,
) -> nvshmem_heap.HeapNeed:
    """The heap need of OdcFSDP's buffers for these FSDP2 groups on `world_size` ranks: per group
    its published shard (in the dtype _group.GroupState publishes: the in-place dtype, else
    param_dtype) and an fp32 accumulator of its trainable slots, plus one float per parameter
    tensor (the reduced flags), plus the communicator's budgets."""
    published = elements = num_slots = 0
    for layout in layouts:
        dtype = internals.in_place_dtype(layout) or layout.param_dtype
        published += layout.shard_numel * (4 if dtype == torch.float32 else 2)
        elements += sum(s.padded_numel for s in layout.slots if s.param.requires_grad)
        num_slots += len(layout.slots)
    elements += -(-num_slots // world_size)  # OdcFSDP._bind_reduced_flags
    return nvshmem_heap.heap_need(
        published, elements, world_size, ranks_per_node, deterministic=deterministic
    )


def model_layouts(model: nn.Module) -> list:
    """The FSDP2 groups of a model wrapped with fully_shard, in OdcFSDP's order."""
    from torch.distributed.fsdp import FSDPModule

    internals.lazy_init(model)  # idempotent; OdcFSDP runs it too
    layouts = (internals.group_layout(m) for m in model.modules() if isinstance(m, FSDPModule))
    return [layout for layout in layouts if layout is not None]


def size_nvshmem_heap(
    model: nn.Module,
    world_size: int,
    ranks_per_node: Optional[int] = None,
    *,
    deterministic: bool = False,
) -> nvshmem_heap.HeapSizing:
    """Local: sizes NVSHMEM's heap (the nvshmem_heap_bytes this process's next odc.Comm passes
    when given none; the environment is left as it is) to what OdcFSDP over a communicator of
    `world_size` ranks (nodes of `ranks_per_node`; None: from the environment) will hold for this
    fully_shard model, unless the user set NVSHMEM_SYMMETRIC_SIZE or ODC_NVSHMEM_HEAP_GIB. Call it
    on every rank before the process's first NVSHMEM communicator; after it, raises InvalidUsage
    where the reserved heap is smaller than the need. Returns what it decided
    (odc.nvshmem_heap.HeapSizing: need, action, heap_bytes)."""
    need = layouts_need(
        model_layouts(model), world_size, ranks_per_node, deterministic=deterministic
    )
    return nvshmem_heap.size_heap(need)
