"""Every use of FSDP2 private internals by odc.torch, in one file.

Checked against torch 2.11 (torch/distributed/fsdp/_fully_shard/*.py; details and line references
in docs/notes/fsdp2_integration.md). Everything outside this file uses public torch API only.
Invariant: these helpers only read FSDP2 state (plus FSDP2's own idempotent lazy init); they never
patch FSDP2 functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

CHECKED_TORCH_VERSIONS = ("2.11",)


def check_torch_version(version: Optional[str] = None) -> None:
    """Raises RuntimeError unless torch is a version these internals were checked against."""
    found = (version or torch.__version__).split("+")[0]
    if not any(found == v or found.startswith(v + ".") for v in CHECKED_TORCH_VERSIONS):
        raise RuntimeError(
            f"odc.torch was checked against torch {', '.join(CHECKED_TORCH_VERSIONS)}; found "
            f"torch {torch.__version__}. FSDP2 internals it reads may differ: use torch 2.11."
        )


check_torch_version()

# The protocol classes FSDPModule.set_custom_all_gather / set_custom_reduce_scatter take: public
# methods, private module (torch.distributed.fsdp does not re-export them in 2.11).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: E402

__all__ = [
    "AllGather",
    "GroupLayout",
    "ParamSlot",
    "ReduceScatter",
    "all_gather_input",
    "check_torch_version",
    "group_layout",
    "lazy_init",
    "shard_process_group",
]


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
    # FSDPModule._get_fsdp_state() -> FSDPState._fsdp_param_group (None: the module owns no params)
    return module._get_fsdp_state()._fsdp_param_group


def lazy_init(root: nn.Module) -> None:
    """FSDP2 sets dtypes and padding at the root's first forward; odc.torch needs them before
    (minibatch_begin publishes shards). FSDPState._lazy_init is idempotent."""
    root._get_fsdp_state()._lazy_init()


def group_layout(module: nn.Module) -> Optional[GroupLayout]:
    """Params in FSDPParamGroup.fsdp_params order, each its padded local shard
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
    """The 1-D tensor FSDP2 copies into its all-gather input for the group's index-th param
    (padded local shard in param_dtype): FSDPParam.all_gather_inputs[0]."""
    return _param_group(module).fsdp_params[index].all_gather_inputs[0]


def shard_process_group(module: nn.Module):
    """The process group FSDP2 hands to the custom all-gather / reduce-scatter."""
    return _param_group(module).mesh_info.shard_process_group
