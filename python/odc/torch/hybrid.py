"""Hybrid sharding for odc.torch: FSDP2 HSDP meshes (2-D, (replicate, shard)). ODC runs inside
each replica (the ranks of one shard group: one node), and once per minibatch, after the node's
sums are final, every fp32 gradient shard is all-reduced (summed) across the replicate dimension
through torch.distributed.

Invariant: FSDP2's own per-microbatch HSDP all-reduce is off (set_requires_all_reduce(False)), so
the only cross-replica communication of a minibatch is ReplicaReduction.reduce at its end; ranks
of every node may therefore run different numbers of microbatches.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from ..comm import Comm
from ..errors import InvalidArgument
from ._errors import MismatchError
from .process_group import comm_from_process_group

# FSDP2 builds HSDP meshes as (replicate, shard): _fsdp_init._get_mesh_info uses
# HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) for every 2-D mesh.
REPLICATE_DIM, SHARD_DIM = 0, 1


def is_hybrid(param) -> bool:
    """True for a parameter sharded by fully_shard on a 2-D HSDP mesh (Replicate(), Shard(d)),
    False on a 1-D mesh; NotImplementedError for every other layout (e.g. tensor parallelism)."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim == 1:
        return False
    if (
        mesh.ndim == 2
        and len(placements) == 2
        and isinstance(placements[0], Replicate)
        and type(placements[1]) is Shard
    ):
        return True
    raise NotImplementedError(
        "odc.torch supports fully_shard on a 1-D mesh (flat ODC) or on a 2-D HSDP mesh "
        f"(replicate, shard) with placements (Replicate(), Shard(d)); got a {mesh.ndim}-D mesh "
        f"with placements {placements}"
    )


def node_comm(
    mesh,
    key: Optional[str] = None,
    device: Optional[int] = None,
    timeout: Optional[float] = None,
    cuda_sms: Optional[int] = None,
):
    """The odc communicator of this rank's node on an HSDP `mesh` (replicate, shard): the ranks of
    its shard group, ranked by their shard coordinate. Collective over the shard group.

    Its key is drawn per job and per node: rank 0 of the shard group picks a random one and
    publishes it in the group's store (comm_from_process_group(mesh.get_group("shard")) does the
    same), so the nodes' communicators never meet, nor do two jobs' that start at the same
    instant. `key` is ignored (kept so that calls written as node_comm(mesh, key) still work).
    device: this rank's CUDA device (default: the current one on an NCCL mesh, else a host
    communicator); timeout: seconds any wait on another rank may take; cuda_sms: the CUDA
    transport's SM budget (odc.Comm's)."""
    del key  # a user's key is not unique per job (docs/torch.md): the store's is
    if mesh.ndim != 2:
        raise InvalidArgument(
            f"node_comm needs a 2-D HSDP mesh (replicate, shard), got {mesh.ndim}-D"
        )
    return comm_from_process_group(
        mesh.get_group(SHARD_DIM), device=device, timeout=timeout, cuda_sms=cuda_sms
    )


def replica_reduction(layouts, comm: Comm) -> Optional["ReplicaReduction"]:
    """The cross-replica reduction for OdcFSDP's parameter groups: None when they are sharded on
    a 1-D mesh (flat ODC), a ReplicaReduction on an HSDP mesh."""
    params = [layout.slots[0].param for layout in layouts]
    kinds = {is_hybrid(param) for param in params}
    if kinds != {True}:
        if len(kinds) > 1:
            raise NotImplementedError("odc.torch: some fully_shard modules use HSDP, some not")
        return None
    return ReplicaReduction.for_params(params, comm)


class ReplicaReduction:
    """Sums fp32 gradient shards across the replicas of an HSDP mesh, once per minibatch.

    One asynchronous all-reduce per FSDP2 parameter group (a bucket: one transformer layer's
    shard, or the root's), all launched before any is waited on:
    - GPUs (NCCL): the all-reduces queue back to back on NCCL's stream, which starts after the
      current stream's minibatch_end; the current stream then waits for them without the host
      blocking, so the host returns at once and queues clipping and the optimizer step behind;
      no host round trip separates one bucket from the next.
    - CPU (gloo): the all-reduces run concurrently on gloo's threads; wait() blocks the host.
    `seconds` is the last reduction's time: from the node's sums being final (the current stream
    after minibatch_end) to the last bucket summed; on GPUs read it after a synchronize.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.num_replicas = group.size()
        self.device = device
        self._events = None  # (start, end) CUDA events of the last reduction
        self._seconds = 0.0
        self.bytes_per_minibatch = 0  # fp32 bytes this rank all-reduces per minibatch

    @staticmethod
    def for_params(params: Sequence[torch.nn.Parameter], comm: Comm) -> "ReplicaReduction":
        """From the sharded parameters of every group (all on one HSDP mesh); checks that the
        communicator spans exactly the mesh's shard dimension."""
        meshes = {id(p.device_mesh): p.device_mesh for p in params}
        if len(meshes) != 1:
            raise NotImplementedError(
                "odc.torch hybrid sharding needs every fully_shard module on the same HSDP mesh"
            )
        (mesh,) = meshes.values()
        if mesh.size(SHARD_DIM) != comm.world_size or (mesh.get_local_rank(SHARD_DIM) != comm.rank):
            raise MismatchError(
                f"the odc communicator (rank {comm.rank} of {comm.world_size}) must span the HSDP "
                f"mesh's shard dimension (this rank is {mesh.get_local_rank(SHARD_DIM)} of "
                f"{mesh.size(SHARD_DIM)} there): build it with odc.torch.node_comm(mesh)"
            )
        return ReplicaReduction(mesh.get_group(REPLICATE_DIM), params[0].device)

    @staticmethod
    def disable_fsdp_all_reduce(modules) -> None:
        """FSDP2 would all-reduce every layer's reduce-scatter output across replicas per
        microbatch (a collective inside the minibatch, and of zeros under ODC): keep it off.
        Re-applied at every minibatch_begin, since set_requires_gradient_sync(True) turns it on."""
        for module in modules:
            module.set_requires_all_reduce(False, recurse=False)

    def reduce(self, accumulators: List[torch.Tensor]) -> None:
        """Sums each tensor across replicas in place. On GPUs in stream order: call it right
        after the node's minibatch_end on the same (current) stream."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            begin = time.perf_counter()
        works = [
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            for tensor in accumulators
        ]
        for work in works:
            work.wait()  # GPU: the current stream waits; CPU: the host waits
        self.bytes_per_minibatch = sum(t.numel() * t.element_size() for t in accumulators)
        if on_gpu:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (start, end)
        else:
            self._seconds = time.perf_counter() - begin

    @property
    def seconds(self) -> float:
        """Duration of the last reduce() (0 before the first); waits for it on GPUs."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return self._seconds


__all__ = ["ReplicaReduction", "is_hybrid", "node_comm", "replica_reduction"]
