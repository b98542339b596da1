"""Every use of FSDP2 private internals by the ODC prototype, in one file.

Checked against torch 2.11.0 (torch/distributed/fsdp/_fully_shard/*.py). Everything outside this
file uses public torch API only. Invariant: these helpers only read FSDP2 state (plus one
idempotent lazy init); they never patch FSDP2 functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

CHECKED_TORCH_VERSIONS = ("2.11",)

# The protocol classes that FSDPModule.set_custom_all_gather / set_custom_reduce_scatter take.
# Public methods, private module: torch.distributed.fsdp does not re-export them in 2.11.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["AllGather", "GroupLayout", "ParamSlot", "ReduceScatter", "check_torch_version"]


def check_torch_version() -> None:
    version = torch.__version__.split("+")[0]
    if not any(version == v or version.startswith(v + ".") for v in CHECKED_TORCH_VERSIONS):
        raise RuntimeError(
            f"odc FSDP2 integration was checked against torch {CHECKED_TORCH_VERSIONS}, "
            f"found torch {torch.__version__}"
        )


@dataclass
class ParamSlot:
    """Where one sharded parameter sits in its group's flat all-gather input (per rank)."""

    param: nn.Parameter  # the sharded DTensor parameter the optimizer holds
    offset: int  # elements into the group's per-rank flat buffer
    padded_numel: int  # padded local shard (dim-0 chunk size of ceil(dim0 / N) rows)
    local_numel: int  # unpadded local shard numel (may be 0 on the last ranks)


@dataclass
class GroupLayout:
    module: nn.Module
    slots: list[ParamSlot]
    shard_numel: int  # S: per-rank flat numel of the group (sum of padded_numel)
    param_dtype: torch.dtype  # the all-gather dtype (MixedPrecisionPolicy.param_dtype or orig)
    reduce_dtype: torch.dtype  # the reduce-scatter input dtype
    orig_dtype: torch.dtype


def _param_group(module: nn.Module):
    # FSDPModule._get_fsdp_state() -> FSDPState._fsdp_param_group (None if it owns no params)
    return module._get_fsdp_state()._fsdp_param_group


def lazy_init(root: nn.Module) -> None:
    """FSDP2 initializes dtypes / padding on the root's first forward; we need them before
    (minibatch_begin publishes shards). FSDPState._lazy_init is idempotent."""
    root._get_fsdp_state()._lazy_init()


def group_layout(module: nn.Module) -> GroupLayout | None:
    """The flat per-rank layout FSDP2's foreach_all_gather / foreach_reduce use for `module`'s
    parameter group: params in FSDPParamGroup.fsdp_params order, each contributing its padded
    local shard FSDPParam._sharded_param_data (padded_sharded_param_size)."""
    group = _param_group(module)
    if group is None:
        return None
    slots, offset = [], 0
    dtypes = set()
    for fsdp_param in group.fsdp_params:
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise NotImplementedError("FSDP2 all-gather extensions (e.g. float8) are not supported")
        padded = fsdp_param._sharded_param_data.numel()
        slots.append(
            ParamSlot(
                fsdp_param.sharded_param,
                offset,
                padded,
                fsdp_param.sharded_param.to_local().numel(),
            )
        )
        offset += padded
        dtypes.add(fsdp_param.param_dtype or fsdp_param.orig_dtype)
    if len(dtypes) != 1:
        raise NotImplementedError(f"mixed all-gather dtypes in one group: {dtypes}")
    orig = group._orig_dtype
    return GroupLayout(
        module=module,
        slots=slots,
        shard_numel=offset,
        param_dtype=dtypes.pop(),
        reduce_dtype=group._reduce_dtype or (group.fsdp_params[0].param_dtype or orig),
        orig_dtype=orig,
    )


def all_gather_input(slot_owner: nn.Module, index: int) -> torch.Tensor:
    """The exact 1-D tensor FSDP2 would copy into its all-gather input for the index-th param
    of the group (padded local shard cast to param_dtype): FSDPParam.all_gather_inputs[0]."""
    fsdp_param = _param_group(slot_owner).fsdp_params[index]
    return fsdp_param.all_gather_inputs[0]


def shard_process_group(module: nn.Module):
    """The process group FSDP2 hands to the custom all-gather / reduce-scatter."""
    return _param_group(module).mesh_info.shard_process_group
