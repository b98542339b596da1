""".grad inside an ODC minibatch: a placeholder that says where the gradients are.

Inside a minibatch the gradient sums are being built in odc's accumulators by every rank's
pushes; they exist, complete, only after minibatch_end. FSDP2 would hand out (and a user would
read) per-microbatch gradients there, and a `.grad` that is None makes gradient-norm clipping
return 0 and clip nothing, silently. So during a minibatch every trainable sharded parameter's
.grad is a DTensor around a `SumsPending` local tensor: it has the gradient's shape, dtype and
device but no storage, absorbs FSDP2's own `grad._local_tensor += output` (the zeros odc hands
FSDP2 after each push, _fsdp2_internals R5), lets views and detaches through (DTensor makes them),
and raises GradientsNotReadyError, naming the fix, at any other use: clipping, norms, reads,
optimizer arithmetic.

Invariant: a SumsPending never holds or allocates memory for its elements.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten

# Ops that only re-describe a tensor (what DTensor.from_local and .grad assignment run): passed
# through as another placeholder of the resulting shape, computed on the meta device.
_VIEWS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.expand.default,
    _aten.slice.Tensor,
}
# FSDP2 adds the reduce-scatter output into an existing .grad: odc hands it zeros, whose sum
# lives in the accumulator, so the add is absorbed.
_ABSORBED = {_aten.add_.Tensor}

MESSAGE = (
    "odc.torch: gradients are not available inside a minibatch: every rank's microbatches are "
    "still being summed into odc's accumulators, and .grad holds the sums only after "
    "minibatch_end(). Clip (clip_grad_norm_), read or modify gradients after the "
    "`with engine.minibatch():` block (or engine.minibatch_end()), before optimizer.step()"
)


class GradientsNotReadyError(RuntimeError):
    """A gradient was used inside an ODC minibatch, before its sums exist."""


class SumsPending(torch.Tensor):
    """A tensor with a gradient's metadata and no data (see the module docstring)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, device=None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            dtype=like.dtype,
            device=like.device if device is None else device,
            requires_grad=False,
        )

    def __repr__(self) -> str:  # printing a .grad inside a minibatch must not raise
        return f"SumsPending(shape={tuple(self.shape)}, dtype={self.dtype}: {MESSAGE})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ABSORBED and isinstance(args[0], SumsPending):
            return args[0]
        if func in _VIEWS:
            meta = func(*[_as_meta(a) for a in args], **kwargs)
            return SumsPending(meta, device=args[0].device)
        raise GradientsNotReadyError(f"{MESSAGE} (it ran {func})")


def _as_meta(value):
    if isinstance(value, SumsPending):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def pending_like(param: torch.Tensor) -> torch.Tensor:
    """The placeholder .grad for a sharded (DTensor) parameter: a DTensor with the parameter's
    mesh, placements, shape and stride around a SumsPending of its local shard's shape."""
    from torch.distributed.tensor import DTensor

    local = param.to_local()
    return DTensor.from_local(
        SumsPending(local),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
