"""Every use of FSDP2 behaviour that is not public API, in one file, each with its reason.

Checked against torch 2.9.1 and 2.11.0 (torch/distributed/fsdp/_fully_shard/*.py; line references
for 2.11 in docs/notes/fsdp2_integration.md). Everything outside this file uses public torch API
only. Each reliance below is exercised by tests/python/test_torch_fsdp2_internals.py, which fails
naming the reliance if a torch release changes it.
Invariant: these helpers only read FSDP2 state (plus FSDP2's own idempotent lazy init, R7's
storage move and R12's reduce without FSDP2's bookkeeping); they never patch FSDP2's functions or
classes (R12 sets one attribute of each odc-managed parameter group, which falls back to FSDP2's
own method wherever its conditions do not hold). Importing this module works on any torch 2.x: the features odc.torch needs
are checked by `check_fsdp2_support()`, which OdcFSDP calls when it is constructed.

Reliances (R1-R13):
- R1 import path: the protocol classes that FSDPModule.set_custom_all_gather /
  set_custom_reduce_scatter take live in torch.distributed.fsdp._fully_shard._fsdp_api (public
  methods, not re-exported by torch.distributed.fsdp). FSDP2 does no isinstance check, so where the
  import fails the classes fall back to `object` and the hooks still work by duck typing.
- R2 parameter groups: FSDPModule._get_fsdp_state()._fsdp_param_group and its fsdp_params,
  mesh_info.shard_process_group and _reduce_dtype: the flat layout FSDP2 hands the hooks is not
  described by any public API, and odc.torch must size its symmetric buffers before the first
  forward.
- R3 lazy init: FSDPState._lazy_init() fixes dtypes and padding at the root's first forward;
  odc.torch needs them earlier (minibatch_begin publishes shards). It is idempotent.
- R4 parameter shards: FSDPParam._sharded_param_data (padded 1-D shard), sharded_param,
  param_dtype / orig_dtype, _sharded_local_tensor, all_gather_inputs: which bytes FSDP2 would
  all-gather, at which offsets (the same offsets for the reduce-scatter input rows).
- R5 the .grad of a reduce: when a sharded parameter has no .grad, FSDP2's foreach_reduce sets
  it to a view of the reduce-scatter output; when it has one, it adds the output into
  .grad._local_tensor; then it calls the parameter's post-accumulate-grad hooks (outside
  compiled autograd), keeping no other reference to the output. odc.torch sets every trainable
  .grad to a storage-less placeholder at minibatch begin (_sums_pending: it absorbs that add and
  raises at any other use) and its hook puts the placeholder back where FSDP2 assigned a view, so
  FSDP2 keeps no per-microbatch gradient (the sums are in the ODC accumulators) and each output
  is freed when its reduce returns. Where the hook did not run (compiled autograd, or an upstream
  change) after a zero_grad inside a minibatch, FSDP2 would keep one output per group and add
  later ones' zeros into it: the same sums, more memory; a .grad must never view an accumulator
  during a minibatch (FSDP2 would add into it while peers push), hence the placeholder.
- R6 world size 1: FSDP2 bypasses the custom all-gather on one rank (2.11 also the custom
  reduce-scatter; 2.9 still calls that one), so odc.torch refuses N=1.
- R7 sharded storage in symmetric memory (the one write): FSDPParam._sharded_param_data is the
  padded 1-D shard FSDP2 all-gathers from, and sharded_param._local_tensor (what the optimizer
  updates) a view of it. odc.torch points both at its published buffer, as FSDP2's own
  reset_sharded_param does after load_state_dict(assign=True) or nn.Module._apply: peers then pull
  the shard the optimizer wrote, with no second copy (2 bytes per parameter element, 3.55 GiB per
  rank on the 7b preset: docs/benchmarks-archive.md, "odc.torch memory at 64K"). FSDP2 runs
  reset_sharded_param after nn.Module._apply and every load_state_dict: 2.11 leaves a shard alone
  while its storage is unchanged, 2.9 re-pads an uneven (trailing-rank) shard into new memory;
  either way publish() (every minibatch_begin) finds the shard moved and moves it back with its
  current values.
- R8 which parameters a reduce covers: FSDPParamGroup.post_backward reduces only the parameters
  whose unsharded parameter (FSDPParam._unsharded_param, one nn.Parameter per FSDPParam made at
  its first all-gather and reused, the leaf autograd accumulates into) got a .grad in that
  backward, packed in fsdp_params order (frozen parameters, and parameters a microbatch did not
  use, are left out of the reduce-scatter input). odc.torch observes which with a
  post-accumulate-grad hook on each unsharded parameter, registered by a forward pre-hook that
  runs after FSDP2's own (FSDP2 prepends its pre-forward hook, which makes the unsharded
  parameters), and checks the packed size against them before every push. Where R12's
  post_backward is installed it reads them from FSDP2's state instead, as FSDP2's post_backward
  does, before either reduce (no hook per parameter: ~340 Python calls per microbatch fewer for
  the 1.5b preset).
- R9 recovery after a backward that raised: FSDP2 ends a backward in the root's final callback
  (FSDPState._root_post_backward_final_callback), which an exception inside backward skips. Left
  as it is, FSDPStateContext.post_backward_final_callback_queued stays True (no later backward
  queues the callback, so groups a backward does not reach are never reduced and never return
  to IDLE), groups stay in PRE_BACKWARD / POST_BACKWARD, and unsharded parameters keep the
  failed microbatch's .grad (FSDPParam._unsharded_param.grad, unsharded_accumulated_grad), which
  the next backward adds to. odc.torch resets exactly these (what the callback would have) and
  reshards, when a minibatch fails.
- R10 HSDP partial sums: with the replica all-reduce off, FSDP2 keeps a group's reduce-scatter
  output across backwards (FSDPParamGroup._partial_reduce_output) and adds the next output into
  it, which needs equal sizes: a reduce of a subset of the group (R8) after a full one fails.
  ODC's outputs are zeros, so odc.torch drops the kept one before each forward of the group.
- R11 the gradient divide factor: FSDPParamGroup.gradient_divide_factor holds what
  set_gradient_divide_factor set (None: divide by the data-parallel size). FSDP2 divides after
  the reduce-scatter (fp32/bf16: post-divide of the output, which odc.torch hands back zeroed),
  so odc.torch reads the factor before making FSDP2 sum and divides the sums itself at
  minibatch_end: FSDP2's gradients, whatever the user's loss normalization.
- R12 the per-microbatch reduce without FSDP2's bookkeeping: FSDPParamGroup.post_backward is
  called through the group's attribute (RegisterPostBackwardFunction.backward, the root's final
  callback, compiled autograd's pre_backward), so a bound function set on the group instance runs
  instead of the class's. Inside an ODC minibatch on a 1-D mesh, FSDP2's foreach_reduce would
  run its whole per-parameter post-reduce (an as_strided view, the placeholder .grad's absorbed
  add, and the hooks of every parameter, an allocated and zeroed output per group) to add zeros:
  33 ms of host time per microbatch for the 1.5b preset on an H200 host, a microbatch's worth
  FSDP2 pays once per minibatch when it defers (docs/benchmarks.md, "5. The host floor").
  install_reduce_without_bookkeeping sets a post_backward that does what FSDP2's does up to the
  reduce (accumulate, collect the gradients of the parameters that got one in fsdp_params order
  (R8), reshard, order after the last reduce's event), copies them in as FSDP2 does
  (torch.ops.fsdp.chunk_cat into the reduce dtype, dim-0 padded to the world size: the same
  bytes, so the same sums), pushes on FSDP2's reduce-scatter stream, keeps the input alive in
  comm_ctx.reduce_scatter_state and sets _post_reduce_event as FSDP2 does, and calls the sharded
  parameters' post-accumulate-grad hooks. It falls back to FSDP2's method (which calls OdcReduceScatter) outside a minibatch, on
  HSDP meshes, with compiled autograd, CPU offload, non-zero shard dims, gradient sync turned off,
  FSDP2's sum reduction not forced, an all-reduce hook, mixed gradient dtypes, or where a
  torch release lacks any attribute it reads.
- R13 FSDP2's communication streams: FSDPParamGroup.comm_ctx.reduce_scatter_stream (where the
  pushes run on GPUs). minibatch_end orders the current stream after it, since FSDP2's
  end-of-backward callback does so only when set_is_last_backward(True) holds; none on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from ..errors import InvalidUsage
from ._errors import MismatchError, UnexplainedStateError

# Versions this file was read against and the tests were run on (docs/torch.md records the runs).
CHECKED_TORCH_VERSIONS = ("2.9", "2.11")
# The oldest release with every FSDPModule method below (set_custom_all_gather and
# set_custom_reduce_scatter appeared in 2.9; docs/torch.md says how this was established).
OLDEST_SUPPORTED_TORCH = "2.9"
# Public FSDPModule methods odc.torch calls; their presence is the version check.
REQUIRED_FSDP_METHODS = (
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_is_last_backward",
    "reshard",
)

try:  # R1
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # older or reorganized torch: duck typing still works (no isinstance check)
    AllGather = ReduceScatter = object

__all__ = [
    "AllGather",
    "GroupLayout",
    "ParamSlot",
    "ReduceScatter",
    "all_gather_input",
    "alias_sharded_param",
    "sharded_storage",
    "check_fsdp2_support",
    "group_layout",
    "forget_partial_reduce_output",
    "install_reduce_without_bookkeeping",
    "lazy_init",
    "NOT_AFTER_DIRECT_PUSH",
    "order_current_stream_after_reduces",
    "recover_after_failed_backward",
    "missing_fsdp2_features",
    "shard_process_group",
    "unsharded_param",
]


def missing_fsdp2_features(fsdp_module_class=None) -> List[str]:
    """Names of the FSDP2 features odc.torch needs that this torch lacks (empty: all present)."""
    if fsdp_module_class is None:
        try:
            from torch.distributed.fsdp import FSDPModule as fsdp_module_class
        except ImportError:
            return ["torch.distributed.fsdp.FSDPModule (FSDP2)"]
    return [
        f"FSDPModule.{name}"
        for name in REQUIRED_FSDP_METHODS
        if not callable(getattr(fsdp_module_class, name, None))
    ]


def check_fsdp2_support(fsdp_module_class=None) -> None:
    """Raises odc.InvalidUsage (a RuntimeError) naming what is missing unless torch has every
    FSDP2 hook odc.torch uses. A feature check, not a version string: builds that backport the
    hooks pass."""
    missing = missing_fsdp2_features(fsdp_module_class)
    if missing:
        raise InvalidUsage(
            f"odc.torch needs FSDP2's custom communication hooks, which torch "
            f"{torch.__version__} lacks ({', '.join(missing)}): use torch >= "
            f"{OLDEST_SUPPORTED_TORCH}"
        )


@dataclass
class ParamSlot:
    """Where one sharded parameter sits in its group's flat per-rank all-gather input."""

    param: nn.Parameter  # the sharded DTensor parameter the optimizer holds
    offset: int  # elements into the group's per-rank flat buffer
    padded_numel: int  # padded local shard: ceil(dim0 / N) rows
    local_numel: int  # unpadded local shard (0 on trailing ranks of small params)


@dataclass
class GroupLayout:
    """The flat layout FSDP2's all-gather and reduce-scatter use for one parameter group."""

    module: nn.Module
    slots: List[ParamSlot]
    shard_numel: int  # S: elements per rank (sum of padded_numel)
    param_dtype: torch.dtype  # all-gather dtype (MixedPrecisionPolicy.param_dtype or original)
    reduce_dtype: torch.dtype  # reduce-scatter input dtype


def _param_group(module: nn.Module):
    # R2: FSDPModule._get_fsdp_state() -> FSDPState._fsdp_param_group (None: no params)
    return module._get_fsdp_state()._fsdp_param_group


def lazy_init(root: nn.Module) -> None:
    """R3: FSDP2 sets dtypes and padding at the root's first forward; odc.torch needs them
    before (minibatch_begin publishes shards). FSDPState._lazy_init is idempotent."""
    root._get_fsdp_state()._lazy_init()


def _comm_streams(modules, names):
    """R13: FSDP2's communication streams of the parameter groups of `modules`
    (FSDPParamGroup.comm_ctx, shared by a root's groups on GPUs), each once; none on the CPU or
    on a torch release without them."""
    streams = {}
    for module in modules:
        group = _param_group(module)
        context = getattr(group, "comm_ctx", None)
        for name in names:
            stream = getattr(context, name, None)
            if isinstance(stream, torch.cuda.Stream):
                streams[id(stream)] = stream
    return list(streams.values())


def order_current_stream_after_reduces(modules) -> None:
    """R13: the current stream waits for FSDP2's reduce-scatter stream, where odc's pushes run,
    so that minibatch_end's barrier follows every push of this rank whether or not FSDP2's
    end-of-backward callback ordered them (it does so only for its last backward)."""
    if not torch.cuda.is_available():
        return
    for stream in _comm_streams(modules, ("reduce_scatter_stream",)):
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def group_layout(module: nn.Module) -> Optional[GroupLayout]:
    """R2 + R4: params in FSDPParamGroup.fsdp_params order, each its padded local shard
    (FSDPParam._sharded_param_data), as foreach_all_gather and foreach_reduce lay them out."""
    group = _param_group(module)
    if group is None:
        return None
    slots, offset, dtypes = [], 0, set()
    for fsdp_param in group.fsdp_params:
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise NotImplementedError("FSDP2 all-gather extensions (e.g. float8) are not supported")
        padded = fsdp_param._sharded_param_data.numel()
        local = fsdp_param.sharded_param.to_local().numel()
        slots.append(ParamSlot(fsdp_param.sharded_param, offset, padded, local))
        offset += padded
        dtypes.add(fsdp_param.param_dtype or fsdp_param.orig_dtype)
    if len(dtypes) != 1:
        raise NotImplementedError(f"one FSDP2 group with several all-gather dtypes: {dtypes}")
    param_dtype = dtypes.pop()
    return GroupLayout(
        module=module,
        slots=slots,
        shard_numel=offset,
        param_dtype=param_dtype,
        reduce_dtype=group._reduce_dtype or param_dtype,
    )


def all_gather_input(module: nn.Module, index: int) -> torch.Tensor:
    """R4: the 1-D tensor FSDP2 copies into its all-gather input for the group's index-th param
    (padded local shard in param_dtype): FSDPParam.all_gather_inputs[0]."""
    return _param_group(module).fsdp_params[index].all_gather_inputs[0]


def gradient_divide_factor(module: nn.Module) -> Optional[float]:
    """R11: what the group's reduce divides the summed gradients by, as set by
    FSDPModule.set_gradient_divide_factor (FSDPParamGroup.gradient_divide_factor; None: FSDP2's
    default, the data-parallel size). Read once, before OdcFSDP makes FSDP2 sum."""
    group = _param_group(module)
    return None if group is None else group.gradient_divide_factor


def shard_process_group(module: nn.Module):
    """R2: the process group FSDP2 hands to the custom all-gather / reduce-scatter."""
    return _param_group(module).mesh_info.shard_process_group


def _fsdp_param(module: nn.Module, index: int):
    return _param_group(module).fsdp_params[index]


def sharded_storage(module: nn.Module, index: int) -> Optional[torch.Tensor]:
    """R4 + R7: the padded 1-D shard FSDP2 keeps for the group's index-th parameter, in its own
    dtype, or None where it cannot move to symmetric memory (CPU offload, float8 extensions)."""
    fsdp_param = _fsdp_param(module, index)
    if getattr(fsdp_param, "offload_to_cpu", False):
        return None
    data = fsdp_param._sharded_param_data
    return data if type(data) is torch.Tensor else None


def alias_sharded_param(module: nn.Module, index: int, flat: torch.Tensor) -> None:
    """R7: copies the index-th parameter's padded shard into `flat` (1-D, same numel and dtype)
    and makes FSDP2's shard and the parameter's local tensor views of it, as
    FSDPParam.reset_sharded_param does when a parameter's storage changes."""
    fsdp_param = _fsdp_param(module, index)
    padded = fsdp_param._sharded_param_data
    if flat.shape != padded.shape or flat.dtype != padded.dtype:
        raise UnexplainedStateError(
            f"odc.torch: shard of {fsdp_param!r} is {tuple(padded.shape)} {padded.dtype}, "
            f"its symmetric slot {tuple(flat.shape)} {flat.dtype}"
        )
    if flat.data_ptr() == padded.data_ptr():
        return
    local = fsdp_param.sharded_param._local_tensor
    shard_dim = fsdp_param.fsdp_placement.dim
    length = local.size(shard_dim) if local.numel() > 0 else 0
    with torch.no_grad():
        flat.copy_(padded)
    fsdp_param._sharded_param_data = flat
    local = flat.view(fsdp_param.padded_sharded_param_size).narrow(shard_dim, 0, length)
    if not local.is_contiguous():
        raise MismatchError(f"odc.torch: {fsdp_param!r} shards unevenly along dim {shard_dim}")
    fsdp_param.sharded_param._local_tensor = local


def unsharded_param(module: nn.Module, index: int) -> Optional[nn.Parameter]:
    """R8: the unsharded parameter autograd accumulates the group's index-th parameter's gradient
    into (FSDPParam._unsharded_param), or None before its first all-gather."""
    return getattr(_fsdp_param(module, index), "_unsharded_param", None)


def recover_after_failed_backward(root: nn.Module) -> None:
    """R9: puts FSDP2 back where its root's final post-backward callback leaves it (every state
    and group IDLE, no callback queued, no unsharded gradient kept), for a backward that raised
    before the callback ran; idempotent, a no-op after a completed backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    context = root._get_fsdp_state()._state_ctx
    for state in context.all_states:
        state._training_state = TrainingState.IDLE
        group = state._fsdp_param_group
        if group is None:
            continue
        group._training_state = TrainingState.IDLE
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None
    context.post_backward_final_callback_queued = False
    context.iter_forward_root = None


# R12: what reduce_without_bookkeeping reads of a parameter group and of its parameters; a torch
# release without one of them keeps FSDP2's own post_backward.
_GROUP_ATTRIBUTES = (
    "fsdp_params", "reduce_grads", "force_sum_reduction_for_comms", "_all_reduce_hook",
    "reshard_after_backward", "comm_ctx", "device_handle", "device", "_reduce_dtype",
    "_reduce_scatter_process_group", "_post_reduce_event", "_training_state",
    "_wait_for_post_backward", "reshard",
)  # fmt: skip
_PARAM_ATTRIBUTES = (
    "accumulate_unsharded_grad_if_needed", "unsharded_accumulated_grad", "offload_to_cpu",
    "fsdp_placement", "sharded_param",
)  # fmt: skip


# A post-accumulate-grad hook of a sharded parameter with this attribute set is not called by
# the direct push (R12) where the parameter still has a .grad: it only puts back a .grad that
# FSDP2's reduce replaced or a zero_grad removed, and the direct push replaces none (odc.torch's
# placeholder keeper; one Python call per parameter and microbatch saved). After a zero_grad
# inside the minibatch (.grad None) it is called, as FSDP2 would.
NOT_AFTER_DIRECT_PUSH = "_odc_not_after_direct_push"


def install_reduce_without_bookkeeping(
    module: nn.Module,
    active: Callable[[], bool],
    push: Callable[[torch.Tensor, object], None],
    mark: Callable[[List[int]], None],
) -> bool:
    """R12: the group's post_backward pushes its gradients with `push(reduce-scatter input,
    process group)` while `active()` (an ODC minibatch on a 1-D mesh) and the conditions above
    hold, else runs FSDP2's own. Either way it first calls `mark(indices)` with the parameters
    (indices into the group's fsdp_params, as GroupLayout.slots) whose gradient the reduce will
    cover (R8), read from FSDP2's state as its post_backward reads it: where it is installed, no
    hook per unsharded parameter needs to observe them. Returns whether it was installed (False:
    a torch release without what it reads, or a module without parameters)."""
    group = _param_group(module)
    if group is None or not all(hasattr(group, name) for name in _GROUP_ATTRIBUTES):
        return False
    if not all(hasattr(p, name) for p in group.fsdp_params for name in _PARAM_ATTRIBUTES):
        return False
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            TrainingState,
            _get_dim0_padded_size,
            compiled_autograd_enabled,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import ReduceScatterState
    except ImportError:
        return False
    fsdp_method = type(group).post_backward.__get__(group)  # the class's, even if reinstalled
    fixed = all(not p.offload_to_cpu and p.fsdp_placement.dim == 0 for p in group.fsdp_params)

    def post_backward(*unused):
        mark(
            [
                i
                for i, p in enumerate(group.fsdp_params)
                if getattr(p, "unsharded_accumulated_grad", None) is not None
                or _has_unsharded_grad(p)
            ]
        )
        if not (
            fixed
            and active()
            and group.reduce_grads
            and group.force_sum_reduction_for_comms
            and group._all_reduce_hook is None
            and getattr(group, "_all_reduce_hook_stream", None) is None
            and not compiled_autograd_enabled()
        ):
            return fsdp_method(*unused)
        fsdp_params = group.fsdp_params
        if len({p._unsharded_param.grad.dtype for p in fsdp_params if _has_unsharded_grad(p)}) > 1:
            return fsdp_method(*unused)  # FSDP2 names the mixed dtypes
        group._training_state = TrainingState.POST_BACKWARD
        for fsdp_param in fsdp_params:
            fsdp_param.accumulate_unsharded_grad_if_needed()
        with_grad, grads = [], []
        for fsdp_param in fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):
                continue
            if fsdp_param.unsharded_accumulated_grad is not None:
                with_grad.append(fsdp_param)
                grads.append(fsdp_param.unsharded_accumulated_grad_data)
                fsdp_param.unsharded_accumulated_grad = None
            elif fsdp_param.unsharded_param.grad is not None:
                with_grad.append(fsdp_param)
                grads.append(fsdp_param.unsharded_grad_data)
                fsdp_param.unsharded_param.grad = None
        if group.reshard_after_backward:
            group.reshard()
        if not with_grad:
            return None
        handle = group.device_handle
        last = group.comm_ctx.reduce_scatter_state
        if last is not None and last.event is not None:
            handle.current_stream().wait_event(last.event)
        group.comm_ctx.reduce_scatter_state = None
        group._wait_for_post_backward()
        process_group = group._reduce_scatter_process_group
        world = process_group.size()
        dtype = group._reduce_dtype or grads[0].dtype
        numel = sum(_get_dim0_padded_size(g.size(), world).numel() for g in grads)
        source = torch.empty((numel,), dtype=dtype, device=group.device)
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world, out=source.view(world, -1))
        grads.clear()  # the unsharded gradients are freed after the copy-in (current stream)
        stream = group.comm_ctx.reduce_scatter_stream
        stream.wait_stream(handle.current_stream())
        with handle.stream(stream):
            push(source, process_group)
            event = stream.record_event()
        group.comm_ctx.reduce_scatter_state = ReduceScatterState(source, event)
        group._post_reduce_event = event
        for fsdp_param in with_grad:  # as FSDP2 calls them after it set or added into .grad
            sharded = fsdp_param.sharded_param
            has_grad = sharded.grad is not None
            for hook in (getattr(sharded, "_post_accumulate_grad_hooks", None) or {}).values():
                if not (has_grad and getattr(hook, NOT_AFTER_DIRECT_PUSH, False)):
                    hook(sharded)
        return None

    group.post_backward = post_backward
    return True


def _has_unsharded_grad(fsdp_param) -> bool:
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return unsharded is not None and unsharded.grad is not None


def forget_partial_reduce_output(module: nn.Module) -> None:
    """R10: drops the reduce-scatter output FSDP2 keeps for the group's HSDP all-reduce."""
    group = _param_group(module)
    if group is not None:
        group._partial_reduce_output = None


def in_place_dtype(layout: GroupLayout) -> Optional[torch.dtype]:
    """The dtype of a group's sharded parameters where they can live in its published buffer
    (R7): one dtype, either the all-gather dtype or float32 gathered as bfloat16; else None."""
    dtypes = set()
    for index in range(len(layout.slots)):
        storage = sharded_storage(layout.module, index)
        if storage is None:
            return None
        dtypes.add(storage.dtype)
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    if dtype == layout.param_dtype or (dtype, layout.param_dtype) == (
        torch.float32,
        torch.bfloat16,
    ):
        return dtype
    return None
