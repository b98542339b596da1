"""Causal attention within each document of one packed sequence, as a transformers attention
function (registered under ATTENTION_NAME). It sits below both the public cost fit (odc.fit) and
the benchmark app (odc.train), which build their models with it: neither imports the other.
torch is needed; transformers only when register_packed_attention() is called."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import InvalidArgument

ATTENTION_NAME = "odc_packed"  # our entry in transformers' AttentionInterface


def varlen_available(device: torch.device) -> bool:
    """Whether flash attention's variable-length kernel can run on `device` (CUDA, a torch
    built with flash attention; bf16/fp16 inputs)."""
    return device.type == "cuda" and _FLASH_BUILT


# Read once at import: a plain bool is all that compiled blocks see (a call into torch._C here
# would break their graphs).
_FLASH_BUILT = torch.backends.cuda.is_flash_attention_available() and hasattr(
    torch.ops.aten, "_flash_attention_forward"
)


def _flash_varlen_causal(q, k, v, boundaries, longest: int, scale):
    """Causal flash attention within each packed document: q [T, heads, dim], k and v
    [T, kv heads, dim] (grouped-query attention), boundaries int32 [documents + 1]. aten's op
    directly, with its own autograd formula: torch.nn.attention.varlen_attn runs the same
    kernels (outputs equal bit for bit, measured on an H200) through Python custom ops that cost
    0.3-0.5 ms of host time per call, 84 calls per microbatch of the 1.5b preset (forward,
    recomputation, backward): 25-40 ms of a short microbatch (docs/benchmarks.md, "5. The host
    floor")."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, boundaries, boundaries, longest, longest, 0.0, True, False, scale=scale
    )[0]


def packed_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers attention function for one packed sequence ([1, heads, T, head_dim] inputs):
    causal attention within each document, whose boundaries come as `cu_seq_lens_q` (int32,
    [documents + 1]) and `max_length_q`. Returns [1, T, heads, head_dim], no weights.

    bf16/fp16 on CUDA: flash attention's varlen kernel (cost grows with sum of L_i^2, not T^2).
    Elsewhere (CPU, fp32): causal SDPA per document, the same arithmetic in a loop.

    With `odc_split` (an odc.torch.split.SplitChunk), the sequence is this rank's chunk of one
    split sample: odc.torch.split.attention (K/V from the group, the sample's causal mask)."""
    if attention_mask is not None:
        raise InvalidArgument(
            "odc packed attention takes document boundaries, not an attention mask"
        )
    split = kwargs.get("odc_split")
    if split is not None:
        if query.shape[0] != 1:
            raise InvalidArgument("odc split attention needs one chunk of one sample")
        from .torch import split as split_execution  # only split samples need odc.torch

        out = split_execution.attention(query[0], key[0], value[0], split, scale=scaling)
        return out.transpose(0, 1).unsqueeze(0), None  # [1, chunk tokens, heads, dim]
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None or query.shape[0] != 1:
        raise InvalidArgument(
            "odc packed attention needs one packed sequence and its cu_seq_lens_q"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    if varlen_available(q.device) and q.dtype in (torch.bfloat16, torch.float16):
        out = _flash_varlen_causal(q, k, v, boundaries, int(kwargs["max_length_q"]), scaling)
        return out.unsqueeze(0), None
    outputs = []
    starts = boundaries.tolist()
    for begin, end in zip(starts[:-1], starts[1:]):
        # [heads, L, head_dim]; key/value heads are shared by groups of query heads (GQA).
        outputs.append(
            F.scaled_dot_product_attention(
                query[0, :, begin:end],
                key[0, :, begin:end],
                value[0, :, begin:end],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=1).transpose(0, 1).unsqueeze(0), None


def register_packed_attention() -> None:
    """Makes `attn_implementation=ATTENTION_NAME` mean packed_attention in transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
