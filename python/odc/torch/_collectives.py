"""FSDP2's custom collectives of one parameter group (set_custom_all_gather and
set_custom_reduce_scatter), which replace FSDP2's per-layer communication. Invariant: inside a
minibatch neither calls the process group; the gather pulls published shards and the
reduce-scatter pushes into the owners' accumulators.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import InvalidUsage
from . import _fsdp2_internals as internals
from ._group import ODC_DTYPES, EngineState, GroupState, comm_view


class OdcAllGather(internals.AllGather):
    """FSDP2 custom all-gather: output[r*S:(r+1)*S] = rank r's published shard (a pull)."""

    def __init__(self, group: GroupState):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        owner = self.group.owner
        if owner.state in (EngineState.READY, EngineState.OFFLOADED):
            # Outside a minibatch (evaluation, generation) a peer may be rewriting its shards
            # (its optimizer step) at any time, so a pull could mix old and new weights: gather
            # as FSDP2 does, with its collective all-gather, which every peer joins after its
            # step, in program order. Collective, as under plain FSDP2; training never gets here.
            # Offloaded: there are no published buffers; the model is plain FSDP2.
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        if owner.state is EngineState.FAILED:
            raise InvalidUsage(
                "odc.torch: forward on a failed engine: its communicator failed in an earlier "
                "minibatch; call reset(<new communicator>) on every rank first"
            )
        self.group.check_group(group)
        # Enqueued on the current stream: FSDP2's all-gather stream on GPUs. float32 shards into
        # a bfloat16 output (mixed precision, R7) are narrowed by odc while they are pulled, with
        # no float32 copy of the gathered group.
        owner.comm.gather(comm_view(output_tensor, owner.comm), self.group.published)
        return None


class OdcReduceScatter(internals.ReduceScatter):
    """FSDP2 custom reduce-scatter: push input[r*S:(r+1)*S] into owner r's accumulator and give
    FSDP2 a zeroed output; the sums exist after minibatch_end."""

    def __init__(self, group: GroupState):
        self.group = group
        self._last_input_numel = -1

    def allocate(self, size, *, dtype, device):
        # 1-D meshes: input and output alike are plain tensors, as FSDP2's default allocates; the
        # output lives only until FSDP2's reduce returns (R5: the .grad it becomes is dropped).
        # HSDP meshes: FSDP2 keeps the output of every group across the minibatch's microbatches
        # as its partial sum for the replica all-reduce we switched off (_partial_reduce_output),
        # 4 bytes per parameter element held for nothing: the output (the allocation of one
        # shard, numel == shard_numel; the input holds world_size shards) is instead a view of
        # one zero buffer shared by every group, since all it ever holds or gets added is zeros.
        # FSDP2 allocates the input, then the output (1/world of it); a reduce of fewer than all
        # parameters (R8) has a smaller input, so the output is told apart by that ratio.
        owner = self.group.owner
        numel = math.prod(size)
        is_output = numel * owner.comm.world_size == self._last_input_numel
        if not is_output:
            self._last_input_numel = numel
        if owner.replica_reduction is not None and is_output:
            return owner.hsdp_zero_output(numel, dtype, device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op != dist.ReduceOp.SUM:
            raise InvalidUsage(
                f"odc.torch pushes sums; FSDP2 asked for {op}: leave FSDP2's reduction settings "
                "(set_force_sum_reduction_for_comms, set_gradient_divide_factor) as OdcFSDP set "
                "them"
            )
        self.push(input_tensor, group)
        output_tensor.zero_()  # what FSDP2 adds into the preset .grad: nothing
        return None

    def push(self, input_tensor, group) -> None:
        """Pushes FSDP2's reduce-scatter input (rank-major rows, one per owner) into the owners'
        accumulators: from __call__, or from the group's post_backward where FSDP2's
        bookkeeping is skipped (_fsdp2_internals R12), on the current stream."""
        owner = self.group.owner
        if owner.state is not EngineState.IN_MINIBATCH:
            raise InvalidUsage("odc.torch: backward outside a minibatch: call minibatch_begin()")
        self.group.check_group(group)
        if self.group.kept:
            self.group.check_carried()
        source = self.group.push_source(input_tensor)
        owner.comm.scatter_accumulate(
            comm_view(source, owner.comm),
            self.group.accumulator,
            src_dtype=ODC_DTYPES[input_tensor.dtype],
        )
