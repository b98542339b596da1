"""Prototype of odc.torch on FSDP2: ODC gather / push behind FSDP2's custom all-gather and
reduce-scatter hooks (public: FSDPModule.set_custom_all_gather / set_custom_reduce_scatter).

Per microbatch FSDP2 runs unchanged, except that its all-gather reads shards every owner
published once per minibatch (symmetric buffers, param_dtype) and its reduce-scatter pushes into
the owners' fp32 accumulators and returns zeros, so FSDP2 accumulates nothing real into `.grad`.
At minibatch end `.grad` of every sharded parameter becomes a DTensor view of its accumulator.
Invariant: no FSDP2 forward/backward path calls the process group, so ranks may run different
numbers of microbatches; minibatch_begin / minibatch_end are the only synchronization.
Host transport only (numpy views); the GPU path would pass CUDA tensors and streams instead.
"""

from __future__ import annotations

import fsdp2_private as private
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_ODC_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16 as uint16 bits) for the host comm."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


class _GroupComm:
    """ODC state of one FSDP2 parameter group: its published shard and its accumulator."""

    def __init__(self, comm, layout: private.GroupLayout):
        self.comm = comm
        self.layout = layout
        self.published = comm.alloc(layout.shard_numel, dtype=_ODC_DTYPES[layout.param_dtype])
        self.accumulator = comm.alloc(layout.shard_numel, accumulator=True)
        # FSDP2 views its reduce-scatter output into `.grad` and adds later outputs into it:
        # handing it this always-zero buffer keeps every per-microbatch `.grad` at zero.
        self.zeros = torch.zeros(layout.shard_numel, dtype=layout.reduce_dtype)
        self.num_gathers = 0
        self.num_pushes = 0

    def check_group(self, group: dist.ProcessGroup) -> None:
        if group.size() != self.comm.world_size or group.rank() != self.comm.rank:
            raise RuntimeError(
                f"FSDP2 group (rank {group.rank()} of {group.size()}) does not match the odc "
                f"communicator (rank {self.comm.rank} of {self.comm.world_size}); "
                "HSDP and reshard_after_forward=<int> are not supported"
            )

    def publish(self) -> None:
        """Owner side, between minibatches: write this rank's shards in param_dtype."""
        flat = self.published.tensor()
        for index, slot in enumerate(self.layout.slots):
            source = private.all_gather_input(self.layout.module, index)
            flat[slot.offset : slot.offset + slot.padded_numel].copy_(source)

    def set_grads(self) -> None:
        """After minibatch_end: `.grad` = DTensor view of this rank's accumulator slice."""
        flat = self.accumulator.tensor()  # fp32, aliases symmetric memory
        for slot in self.layout.slots:
            param = slot.param
            local_shape = param.to_local().shape
            local = flat[slot.offset : slot.offset + slot.local_numel].view(local_shape)
            if param.dtype != torch.float32:
                local = local.to(param.dtype)
            param.grad = DTensor.from_local(
                local,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )


class OdcAllGather(private.AllGather):
    """FSDP2 custom all-gather: output[r*S:(r+1)*S] = rank r's published shard (a pull).

    `input_tensor` (FSDP2's copy-in of this rank's padded shards, a view of output at rank*S)
    is ignored: the gather rewrites that slot with the same bytes from the published buffer."""

    def __init__(self, group_comm: _GroupComm, verify: bool = False):
        self.group_comm = group_comm
        self.verify = verify  # evidence only: also run FSDP2's all-gather and compare bytes
        self.num_verified = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        gc = self.group_comm
        gc.check_group(group)
        fsdp_input = input_tensor.clone() if self.verify else None
        gc.comm.gather(_host_array(output_tensor), gc.published)
        gc.num_gathers += 1
        if self.verify:
            expected = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(expected, fsdp_input, group=group)
            if not torch.equal(expected.view(torch.uint8), output_tensor.view(torch.uint8)):
                raise RuntimeError("odc gather differs from FSDP2's all-gather")
            self.num_verified += 1
        # None: completed (GPU: enqueued on FSDP2's all-gather stream, the current one)


class OdcReduceScatter(private.ReduceScatter):
    """FSDP2 custom reduce-scatter: push input[r*S:(r+1)*S] into owner r's accumulator and
    return zeros; the sums exist only after minibatch_end."""

    def __init__(self, group_comm: _GroupComm):
        self.group_comm = group_comm

    def allocate(self, size, *, dtype, device):
        numel = int(np.prod([int(s) for s in size]))
        if numel == self.group_comm.layout.shard_numel and dtype == self.group_comm.zeros.dtype:
            return self.group_comm.zeros  # the reduce-scatter output
        return torch.empty(*size, dtype=dtype, device=device)  # the reduce-scatter input

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        gc = self.group_comm
        gc.check_group(group)
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(
                f"odc pushes sums; FSDP2 asked for {op} (set_gradient_divide_factor(1.0))"
            )
        if output_tensor.data_ptr() != gc.zeros.data_ptr():
            raise RuntimeError("reduce-scatter output was not allocated by OdcReduceScatter")
        gc.comm.scatter_accumulate(
            _host_array(input_tensor), gc.accumulator, src_dtype=_ODC_DTYPES[input_tensor.dtype]
        )
        gc.num_pushes += 1


class OdcFSDP:
    """Turns ODC on for a model already wrapped with fully_shard (per-layer units and root).

    Usage: odc_model = OdcFSDP(model, comm, optimizer); per minibatch:
    odc_model.minibatch_begin(); for mb in my_microbatches: loss(mb).backward();
    odc_model.minibatch_end(); optimizer.step(); (optimizer.zero_grad() optional)."""

    def __init__(
        self, model: nn.Module, comm, optimizer: torch.optim.Optimizer = None, verify=False
    ):
        private.check_torch_version()
        if not isinstance(model, FSDPModule):
            raise TypeError("OdcFSDP needs a model wrapped with fully_shard (the root)")
        self.model = model
        self.comm = comm
        private.lazy_init(model)
        self.modules: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.groups: list[_GroupComm] = []
        for module in self.modules:  # same order on every rank: alloc is collective
            layout = private.group_layout(module)
            if layout is None:
                continue
            if any(slot.param.device_mesh.ndim != 1 for slot in layout.slots):
                raise NotImplementedError("HSDP / TP meshes: FSDP2 would still all-reduce")
            group_comm = _GroupComm(comm, layout)
            group_comm.check_group(private.shard_process_group(module))
            group_comm.all_gather = OdcAllGather(group_comm, verify)
            module.set_custom_all_gather(group_comm.all_gather)
            module.set_custom_reduce_scatter(OdcReduceScatter(group_comm))
            # Sum, never average (loss is pre-scaled by global tokens); force_sum makes FSDP2
            # pass ReduceOp.SUM with no pre/post division for every reduce dtype.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            self.groups.append(group_comm)
        self.in_minibatch = False
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._check_step)

    def _check_step(self, optimizer, args, kwargs):
        if self.in_minibatch:
            raise RuntimeError("optimizer.step() called before OdcFSDP.minibatch_end()")

    def minibatch_begin(self) -> None:
        if self.in_minibatch:
            raise RuntimeError("minibatch_begin() called twice")
        for module in self.modules:
            module.reshard()  # unsharded params may be stale after the optimizer step
        # FSDP2 then orders the current stream after every push at the end of each backward
        self.model.set_is_last_backward(True)
        for group in self.groups:
            # load_state_dict(assign=True) / module._apply may replace sharded params: re-read
            layout = private.group_layout(group.layout.module)
            if layout.shard_numel != group.layout.shard_numel:
                raise RuntimeError("a parameter group changed size after OdcFSDP was created")
            group.layout = layout
            for slot in group.layout.slots:
                slot.param.grad = None  # FSDP2 must not add into last minibatch's accumulator view
            group.publish()
        self.comm.minibatch_begin()  # zero accumulators, barrier: every shard is published
        self.in_minibatch = True

    def minibatch_end(self) -> None:
        if not self.in_minibatch:
            raise RuntimeError("minibatch_end() without minibatch_begin()")
        self.comm.minibatch_end()  # every push of every rank has landed
        for group in self.groups:
            group.set_grads()
        self.in_minibatch = False


def scale_loss(loss_sum: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """Microbatch loss summed over its tokens / tokens of the whole minibatch on all ranks:
    summing these gradients over all microbatches of all ranks equals the single-process
    gradient of the token-mean loss over the minibatch, whatever the microbatch counts."""
    return loss_sum / float(global_tokens)
