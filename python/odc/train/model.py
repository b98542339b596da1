"""Qwen2-architecture causal LMs from explicit configurations (no download), run on packed
microbatches: documents concatenated into one sequence, attention kept inside each document, and
the LM-head loss computed in chunks so that 64K-token microbatches never hold all their logits.

The model class is transformers' Qwen2ForCausalLM, so transformers must be installed; without it
`build_model` raises a RuntimeError saying so. Weights are random (seeded): the benchmark measures
speed, memory and equality of results, not quality.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import InvalidArgument
from .data import IGNORE_INDEX

# Shapes of the public Qwen2 checkpoints of these sizes (config.json of Qwen2-0.5B/1.5B/7B);
# `tiny` is for CPU runs.
PRESETS = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

ATTENTION_NAME = "odc_packed"  # our entry in transformers' AttentionInterface
LOSS_CHUNK_TOKENS = 4096  # logits of this many tokens at a time: 4096 x 152K fp32 = 2.5 GB


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch's varlen_attn (torch >= 2.10), or None; looked up once, not per attention call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_available(device: torch.device) -> bool:
    """Whether torch's variable-length flash attention can run on `device` (CUDA, torch >= 2.10)."""
    return device.type == "cuda" and _varlen_attn() is not None


class SplitChunk:
    """This rank's part of a sample split over a group of ranks (docs/design.md, "Splitting
    outliers"; the planner's "splits" entry): the chunk's token ranges of the sample, every
    member's ranges (in group order) and the group's process group. The chunk's tokens are the
    concatenation of `pieces` in order, as data.pack_chunk lays them out.

    Deliberately not a dataclass: it reaches every layer's attention as a forward keyword
    argument, and FSDP2's mixed precision casts forward inputs by rebuilding every dataclass it
    finds in them (dataclasses.replace, twice per module call). A rebuilt chunk lost its cached
    index tensors, so each layer rebuilt them on the host from a Python list of the sample's
    length and copied them to the GPU (29,565 tokens: ~3 ms per layer and pass, the GPU idle
    meanwhile; docs/benchmarks.md, seventh round)."""

    def __init__(
        self,
        group,
        member: int,
        chunks: Sequence[Sequence[Tuple[int, int]]],
        length: int,
        exchange: Optional["OdcKVExchange"] = None,
    ) -> None:
        self.group = group  # torch.distributed ProcessGroup of the members, in member order
        self.member = member  # this rank's index in the group
        self.chunks = chunks  # every member's [begin, end) ranges
        self.length = length  # tokens of the whole sample
        # How K/V move between the members: None, an all-gather in `group` (NCCL on GPUs, gloo
        # on the CPU); an OdcKVExchange, pulls from the members' odc symmetric buffers.
        self.exchange = exchange

    @property
    def pieces(self) -> Sequence[Tuple[int, int]]:
        return self.chunks[self.member]

    @property
    def padded_tokens(self) -> int:
        """Rows each member contributes to the all-gather (the longest chunk's tokens)."""
        return max(sum(end - begin for begin, end in c) for c in self.chunks)

    @functools.cached_property
    def _gather_index(self) -> List[int]:
        """For every token of the sample, in order, its row in the all-gathered buffer."""
        index = [0] * self.length
        rows = self.padded_tokens
        for member, chunk in enumerate(self.chunks):
            row = member * rows
            for begin, end in chunk:
                index[begin:end] = range(row, row + end - begin)
                row += end - begin
        return index

    def gather_index(self, device):
        cached = getattr(self, "_index_tensor", None)
        if cached is None or cached.device != device:
            cached = _to(torch.tensor(self._gather_index, dtype=torch.long), device)
            self._index_tensor = cached
        return cached

    def varlen_offsets(self, device):
        """(cu_seqlens_q, cu_seqlens_k, max q, max k) of the pieces as varlen "documents",
        queries [b, e) against keys [0, e); made once per chunk, not once per layer."""
        cached = getattr(self, "_offsets", None)
        if cached is None or cached[0].device != device:
            q_lens = [end - begin for begin, end in self.pieces]
            k_lens = [end for _, end in self.pieces]
            cu_q = _to(torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32), device)
            cu_k = _to(torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32), device)
            cached = (cu_q, cu_k, max(q_lens), max(k_lens))
            self._offsets = cached
        return cached


def _to(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` without making the host wait: a copy from pageable memory would
    synchronize with the stream (and a split chunk would do that in every layer)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class _GroupAllGather(torch.autograd.Function):
    """All-gather along dim 0 within a process group; the gradient returns to each member its
    rows' summed gradient (reduce-scatter under NCCL; all-reduce and slice under gloo, which has
    no reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group, size):
        import torch.distributed as dist

        ctx.group, ctx.size = group, size
        tensor = tensor.contiguous()
        out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
        if dist.get_backend(group) == "nccl":
            dist.all_gather_into_tensor(out, tensor, group=group)
        else:
            dist.all_gather(list(out.chunk(size)), tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        rows = grad.shape[0] // ctx.size
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty((rows, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        else:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            member = dist.get_rank(ctx.group)
            mine = grad[member * rows : (member + 1) * rows].contiguous()
        return mine, None, None


class OdcKVExchange:
    """The K/V exchange of one split group through odc's one-sided operations, the alternative
    to the NCCL all-gather (`odc.train --kv-exchange odc`). Each member writes its chunk's
    rows into its own shard of a symmetric buffer; after one synchronization of the group the
    members pull the others' rows (odc gather). Backward, the same in reverse: each member writes
    the gradient of every member's rows into its shard, and each member pulls and sums the rows
    that belong to it (a reduce-scatter made of pulls, summed in fp32 in member order).

    Synchronization: one 1-element all-reduce in the group's process group per exchange (NCCL on
    GPUs: enqueued on the stream, the host never waits), between the writes and the pulls. Two
    buffers per direction, used alternately, so that one meeting per exchange suffices: a member
    rewrites a buffer only after the meeting of the next exchange, which every member reaches
    only after its pulls from that buffer (stream order). Every member makes the same sequence of
    exchanges (the same layers, forward, recomputation and backward), which keeps the uses paired.

    Construction is collective over the whole odc communicator (it allocates symmetric buffers):
    every rank builds every group's exchange, in the same order, members or not. Non-members'
    shards are never written; a pull reads them too (odc gather reads every rank) and drops them.
    """

    def __init__(self, comm, group, ranks: Sequence[int], rows: int, width: int, dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise InvalidArgument(f"odc K/V exchange moves float32 or bfloat16, not {dtype}")
        if rows < 1 or width < 1:
            raise InvalidArgument(
                f"odc K/V exchange needs rows and width >= 1, got {rows}, {width}"
            )
        self.comm, self.group = comm, group
        self.ranks = [int(r) for r in ranks]
        self.rows, self.width, self.dtype = rows, width, dtype
        self.device = (
            torch.device("cpu") if comm.device is None else torch.device("cuda", comm.device)
        )
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        members = len(self.ranks)
        # forward: a member's rows; backward: the gradient of every member's rows.
        self._buffers = {
            "forward": [comm.alloc(rows * width, dtype=name) for _ in range(2)],
            "backward": [comm.alloc(members * rows * width, dtype=name) for _ in range(2)],
        }
        self._shards = {k: [b.tensor() for b in v] for k, v in self._buffers.items()}
        self._uses = {"forward": 0, "backward": 0}
        self._member_index = torch.tensor(self.ranks, dtype=torch.long, device=self.device)
        self._flag = torch.zeros(1, device=self.device)
        self.bytes = sum(
            b.count * (2 if name == "bfloat16" else 4) for v in self._buffers.values() for b in v
        )

    def _exchange(self, direction: str, flat: torch.Tensor) -> torch.Tensor:
        """Writes `flat` into this member's next `direction` buffer, meets the group, and returns
        every member's written prefix as [members, flat.numel()]."""
        import torch.distributed as dist

        if flat.dtype != self.dtype or flat.device != self.device:
            raise InvalidArgument(
                f"odc K/V exchange was built for {self.dtype} on {self.device}, got "
                f"{flat.dtype} on {flat.device}"
            )
        use = self._uses[direction]
        self._uses[direction] = use + 1
        buffer = self._buffers[direction][use % 2]
        shard = self._shards[direction][use % 2]
        if flat.numel() > shard.numel():
            raise InvalidArgument(
                f"odc K/V exchange: {flat.numel()} elements do not fit the {shard.numel()} of "
                "its buffer (built for a shorter chunk)"
            )
        shard[: flat.numel()].copy_(flat)
        dist.all_reduce(self._flag, group=self.group)  # every member has written
        pulled = torch.empty(
            (self.comm.world_size, shard.numel()), dtype=self.dtype, device=self.device
        )
        out = pulled.view(-1)
        if self.comm.device is None:  # host communicator: numpy views (bf16 as raw bits)
            out = out.view(torch.uint16).numpy() if self.dtype == torch.bfloat16 else out.numpy()
        self.comm.gather(out, buffer)
        return pulled.index_select(0, self._member_index)[:, : flat.numel()]

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[padded chunk rows, ...] of this member -> [members x padded rows, ...]."""
        pulled = self._exchange("forward", rows.contiguous().view(-1))
        return pulled.reshape(len(self.ranks) * rows.shape[0], *rows.shape[1:])

    def reduce_scatter(self, grad: torch.Tensor, member: int) -> torch.Tensor:
        """[members x padded rows, ...] gradient of the gathered rows -> this member's rows,
        summed over the members (in fp32, member order)."""
        members = len(self.ranks)
        rows = grad.shape[0] // members
        pulled = self._exchange("backward", grad.contiguous().view(-1))
        mine = pulled.view(members, members, -1)[:, member]
        return mine.float().sum(0).to(grad.dtype).view(rows, *grad.shape[1:])


class _OdcGroupAllGather(torch.autograd.Function):
    """_GroupAllGather's contract through an OdcKVExchange."""

    @staticmethod
    def forward(ctx, tensor, exchange, member):
        ctx.exchange, ctx.member = exchange, member
        return exchange.all_gather(tensor)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.reduce_scatter(grad, ctx.member), None, None


def _gather_sample(local: torch.Tensor, split: SplitChunk) -> torch.Tensor:
    """[heads, chunk tokens, dim] of this member -> [heads, sample tokens, dim] of the whole
    sample in token order, differentiable (gradients flow back to the members that own them)."""
    rows = local.transpose(0, 1)  # [chunk tokens, heads, dim]
    padding = split.padded_tokens - rows.shape[0]
    if padding:
        rows = F.pad(rows, (0, 0, 0, 0, 0, padding))
    if split.exchange is not None:
        gathered = _OdcGroupAllGather.apply(rows, split.exchange, split.member)
    else:
        gathered = _GroupAllGather.apply(rows, split.group, len(split.chunks))
    ordered = gathered.index_select(0, split.gather_index(gathered.device))
    return ordered.transpose(0, 1)


def _split_attention(query, key, value, scaling, split: SplitChunk):
    """Causal attention of this member's query tokens against the K/V of the whole sample
    (gathered from the group), with the sample's global causal mask: token t sees tokens 0..t.
    Inputs [1, heads, chunk tokens, dim]; returns [1, chunk tokens, heads, dim]."""
    # K and V travel together: one exchange (one meeting of the group) per layer and direction.
    kv_heads = key.shape[1]
    kv_all = _gather_sample(torch.cat([key[0], value[0]], dim=0), split)
    k_all, v_all = kv_all[:kv_heads], kv_all[kv_heads:]  # [kv heads, L, dim] each
    q = query[0]
    if varlen_available(q.device) and q.dtype in (torch.bfloat16, torch.float16):
        # One varlen "document" per piece: queries [b, e) against keys [0, e). Flash attention's
        # causal mask is aligned to the bottom right when there are more keys than queries, so
        # query b + i sees keys 0..b + i: exactly the global causal mask.
        ends = [end for _, end in split.pieces]
        # [sum of ends, kv heads, dim]: each piece's keys are the sample's first `end` tokens.
        keys = torch.cat([k_all[:, :end] for end in ends], dim=1).transpose(0, 1)
        values = torch.cat([v_all[:, :end] for end in ends], dim=1).transpose(0, 1)
        cu_q, cu_k, max_q, max_k = split.varlen_offsets(q.device)
        out = _varlen_attn()(
            q.transpose(0, 1),
            keys,
            values,
            cu_q,
            cu_k,
            max_q,
            max_k,
            scale=scaling,
            window_size=(-1, 0),
        )
        return out.unsqueeze(0)
    positions = torch.cat([torch.arange(b, e, device=q.device) for b, e in split.pieces])
    visible = torch.arange(split.length, device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=visible, scale=scaling, enable_gqa=True
    )  # [heads, chunk tokens, dim]
    return out.transpose(0, 1).unsqueeze(0)


def packed_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers attention function for one packed sequence ([1, heads, T, head_dim] inputs):
    causal attention within each document, whose boundaries come as `cu_seq_lens_q` (int32,
    [documents + 1]) and `max_length_q`. Returns [1, T, heads, head_dim], no weights.

    bf16/fp16 on CUDA: torch's varlen flash attention (cost grows with sum of L_i^2, not T^2).
    Elsewhere (CPU, fp32): causal SDPA per document, the same arithmetic in a loop.

    With `odc_split` (a SplitChunk), the sequence is this rank's chunk of one split sample: K/V
    are gathered from the group and attention follows the sample's global causal mask."""
    if attention_mask is not None:
        raise InvalidArgument(
            "odc packed attention takes document boundaries, not an attention mask"
        )
    split = kwargs.get("odc_split")
    if split is not None:
        if query.shape[0] != 1:
            raise InvalidArgument("odc split attention needs one chunk of one sample")
        return _split_attention(query, key, value, scaling, split), None
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None or query.shape[0] != 1:
        raise InvalidArgument(
            "odc packed attention needs one packed sequence and its cu_seq_lens_q"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    if varlen_available(q.device) and q.dtype in (torch.bfloat16, torch.float16):
        longest = int(kwargs["max_length_q"])
        out = _varlen_attn()(
            q, k, v, boundaries, boundaries, longest, longest, scale=scaling, window_size=(-1, 0)
        )
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


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def build_model(preset: str, seed: int = 0) -> "PackedCausalLM":
    """A randomly initialized Qwen2 model of `preset` (fp32, on the current default device),
    wrapped for packed microbatches."""
    if preset not in PRESETS:
        raise InvalidArgument(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise RuntimeError(
            "odc train builds its models with transformers' Qwen2 classes: "
            "pip install 'transformers>=5'"
        ) from None
    _register_attention()
    config = Qwen2Config(**PRESETS[preset], max_position_embeddings=131072, rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    return PackedCausalLM(Qwen2ForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME))


def _lm_head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)


class PackedCausalLM(torch.nn.Module):
    """Qwen2ForCausalLM (`.lm`) whose forward takes one packed microbatch and returns the summed
    token loss. Shard it like the plain model: `fully_shard` each of `.layers`, then this module."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        return self.lm.config

    @property
    def layers(self):
        return self.lm.model.layers

    def gradient_checkpointing_enable(self) -> None:
        self.lm.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        boundaries: torch.Tensor,
        longest: int,
        split: Optional[SplitChunk] = None,
    ) -> torch.Tensor:
        """input_ids, position_ids, labels: [T]; boundaries: int32 [documents + 1] cumulative
        document lengths; longest: the longest document. Returns the loss summed over tokens.
        With `split`, the inputs are this rank's chunk of a split sample (data.pack_chunk, global
        positions and labels) and every member of split.group must run it at the same time."""
        extra = {} if split is None else {"odc_split": split}
        hidden = self.lm.model(
            input_ids=input_ids.view(1, -1),
            position_ids=position_ids.view(1, -1),
            cu_seq_lens_q=boundaries,
            cu_seq_lens_k=boundaries,
            max_length_q=longest,
            max_length_k=longest,
            **extra,
        ).last_hidden_state[0]
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for begin in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
            end = begin + LOSS_CHUNK_TOKENS
            # Recomputed in backward: only one chunk's logits exist at a time.
            total = total + checkpoint(
                _lm_head_loss_sum, hidden[begin:end], weight, labels[begin:end], use_reentrant=False
            )
        return total
