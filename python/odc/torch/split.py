"""odc.torch.split: run the planner's split samples in your own FSDP2 loop.

The planner (`odc.plan(..., split="auto")`) may split an outlier sample over a group of ranks
(docs/design.md, "Splitting outliers"): its "splits" entries name the sample, the members
(`ranks`) and every member's token ranges (`chunks`, zigzag pieces). Each member runs its chunk
as a microbatch; in every attention layer the members exchange their chunks' keys and values so
that each query token sees the whole sample before it (the global causal mask), and backward
returns each member the gradient of its own keys and values, summed over the members. Losses and
gradients are then those of the whole sample on one rank (tests/python/test_torch_split.py).

    groups = odc.torch.split.SplitGroups(comm, kv_width=2 * kv_heads * head_dim, dtype=dtype)
    groups.prepare(minibatch["splits"])              # collective: every rank, same entries
    for entry in minibatch["splits"]:                # before the rank's own microbatches
        chunk = groups.chunk(entry)                  # None where this rank is not a member
        if chunk is not None:
            tokens, positions = chunk.take(sample_tokens), chunk.positions(device)
            loss = model(tokens, positions, ..., split=chunk)  # attention: split.attention(...)

Two ways to exchange K/V, each a `SplitGroups`:
  - `exchange="odc"` (default): one odc sub-communicator per group (`Comm.split`): forward, each
    member writes its rows into its shard of a symmetric buffer, the group meets on its own
    barrier and every member pulls the k members' shards; backward, each member writes its part
    of every member's rows' gradient, the group meets, and each member pulls the k parts of its
    own rows and sums them in fp32 in member order (deterministic). Every exchange pulls k
    shards for a group of k, buffers exist on the k members only; on GPUs the meetings and pulls
    are queued on the stream (the host does not wait), on the CPU they block.
  - `exchange="process-group"`: a torch.distributed subgroup of the default group (NCCL on GPUs,
    gloo on the CPU): all-gather forward, reduce-scatter backward (gloo: all-reduce and slice).

Memory (odc exchange): a group of k whose longest chunk has R tokens, K/V width W elements per
token, element size E, holds 2 x (1 + k) x R x W x E on each member (forward one buffer,
backward k, each twice, used alternately so that one meeting per exchange suffices), e.g. 1.5b
(W = 512, bf16), R = 16,384, k = 4: 160 MiB. Buffers are held for the groups of the last
`prepare()` only: prepare each minibatch's splits before it runs, and a rank holds the buffers of
the one group it is in (the planner's groups of a minibatch are disjoint); prepare every split of
the run at once, and it holds every group's it belongs to (up to 1.5 GiB per rank for heavy-
tailed data on 8 ranks) but allocates nothing later. `memory_bytes()` reports what is held
(libodc allocates it: torch's statistics do not count it). Process groups hold no buffers of
odc's (NCCL's own, per subgroup, are not counted).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidArgument, InvalidUsage

__all__ = [
    "SplitChunk",
    "SplitGroups",
    "attention",
    "transformers_attention_kwargs",
    "use_transformers_attention",
]

_EXCHANGES = ("odc", "process-group")


class _ProcessGroupExchange:
    """K/V rows through a torch.distributed subgroup: all-gather forward; backward, each member
    gets its rows' gradient summed over the members (reduce-scatter under NCCL; all-reduce and
    slice under gloo, which has no reduce-scatter). A subgroup ranks its members by global rank,
    the split by member order (the planner's): rows are reordered where the two differ."""

    def __init__(self, group, members: Sequence[int]) -> None:
        self.group, self.members = group, len(members)
        by_rank = sorted(members)
        # Group rank g holds member _member_of[g]; member m is group rank _group_rank_of[m].
        self._member_of = [list(members).index(r) for r in by_rank]
        self._group_rank_of = [by_rank.index(r) for r in members]
        self._in_order = by_rank == list(members)
        self.uses = {"forward": 0, "backward": 0}  # exchanges made (tests count them)

    def _nccl(self) -> bool:
        import torch.distributed as dist

        return dist.get_backend(self.group) == "nccl"

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.uses["forward"] += 1
        rows = rows.contiguous()
        out = rows.new_empty((self.members * rows.shape[0], *rows.shape[1:]))
        if not self._nccl():  # gloo: one output tensor per group rank, placed in member order
            parts = out.chunk(self.members)
            dist.all_gather([parts[m] for m in self._member_of], rows, group=self.group)
            return out
        dist.all_gather_into_tensor(out, rows, group=self.group)
        if self._in_order:
            return out
        index = torch.tensor(self._group_rank_of, device=out.device)
        return out.view(self.members, -1).index_select(0, index).view(out.shape)

    def reduce_scatter(self, grad: torch.Tensor, member: int) -> torch.Tensor:
        import torch.distributed as dist

        self.uses["backward"] += 1
        grad = grad.contiguous()
        rows = grad.shape[0] // self.members
        if not self._nccl():  # gloo: sums in member order, keep this member's rows
            grad = grad.clone()
            dist.all_reduce(grad, group=self.group)
            return grad[member * rows : (member + 1) * rows].contiguous()
        if not self._in_order:
            index = torch.tensor(self._member_of, device=grad.device)
            grad = grad.view(self.members, -1).index_select(0, index).view(grad.shape)
        mine = grad.new_empty((rows, *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad, group=self.group)
        return mine


class _OdcExchange:
    """K/V rows through an odc sub-communicator of the group's k members (module docstring).

    Forward: each member writes its rows into its shard of a buffer, the members meet on the
    group's barrier, and each pulls the k shards. Backward: buffer j holds, on every member, that
    member's part of member j's rows' gradient; each member writes its k parts, the members meet,
    and member j pulls buffer j (k shards, nothing else) and sums it in fp32 in member order:
    the same sum on every run, with no accumulator and no accumulation scheme (whose staging
    would cost each group the communicator's whole staging budget).

    Why two sets of buffers and one meeting per exchange: a member rewrites a buffer only after
    the barrier of the next exchange, which every member reaches only after its pulls from that
    buffer (stream order). Every member makes the same sequence of exchanges (same layers,
    forward, recomputation, backward), which keeps the barriers paired."""

    def __init__(self, comm, rows: int, width: int, dtype: torch.dtype, counters: dict) -> None:
        self.comm, self.rows, self.width, self.dtype = comm, rows, width, dtype
        self.members = comm.world_size
        self.device = (
            torch.device("cpu") if comm.device is None else torch.device("cuda", comm.device)
        )
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        count = rows * width
        self._forward = [comm.alloc(count, dtype=name, name=f"odc.split.kv.{i}") for i in (0, 1)]
        self._backward = [
            [
                comm.alloc(count, dtype=name, name=f"odc.split.dkv.{i}.{j}")
                for j in range(self.members)
            ]
            for i in (0, 1)
        ]
        self._forward_shards = [b.tensor() for b in self._forward]
        self._backward_shards = [[b.tensor() for b in parity] for parity in self._backward]
        # The group's counts over every set of buffers it held (SplitGroups.stats): exchanges made
        # ("forward", "backward"; their parity picks the buffer) and elements gathered.
        self.uses = counters
        self.released = False

    def _check(self, flat: torch.Tensor, what: str) -> None:
        if self.released:
            raise InvalidUsage(
                "odc.torch.split: this chunk's group released its buffers in a later prepare(); "
                "take the chunk from SplitGroups.chunk() after the prepare() of its minibatch"
            )
        if flat.dtype != self.dtype or flat.device != self.device:
            raise InvalidArgument(
                f"odc.torch.split: the group's K/V exchange was prepared for {self.dtype} on "
                f"{self.device}, got {flat.dtype} on {flat.device} ({what})"
            )
        if flat.numel() > self.rows * self.width:
            raise InvalidArgument(
                f"odc.torch.split: {what}: {flat.numel()} elements exceed the "
                f"{self.rows * self.width} the group was prepared for (pass every split of the "
                "run to prepare(), and a kv_width of 2 x key/value heads x head dim)"
            )

    def _pull(self, buffer) -> torch.Tensor:
        """[members, shard] of `buffer`'s k shards."""
        pulled = torch.empty(
            (self.members, self.rows * self.width), dtype=self.dtype, device=self.device
        )
        out = pulled.view(-1)
        if self.comm.device is None:  # host calls take numpy; bfloat16 as its uint16 bits
            out = out.view(torch.uint16).numpy() if self.dtype == torch.bfloat16 else out.numpy()
        self.comm.gather(out, buffer)
        self.uses["elements_pulled"] += pulled.numel()
        return pulled

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.contiguous().view(-1)
        self._check(flat, "forward")
        parity = self.uses["forward"] % 2
        self.uses["forward"] += 1
        self._forward_shards[parity][: flat.numel()].copy_(flat)
        self.comm.barrier()  # every member has written its rows
        pulled = self._pull(self._forward[parity])
        return pulled[:, : flat.numel()].reshape(self.members * rows.shape[0], *rows.shape[1:])

    def reduce_scatter(self, grad: torch.Tensor, member: int) -> torch.Tensor:
        rows = grad.shape[0] // self.members
        parts = grad.contiguous().view(self.members, -1)  # [owner, this member's part]
        self._check(parts[0], "backward")
        parity = self.uses["backward"] % 2
        self.uses["backward"] += 1
        size = parts.shape[1]
        for owner, shard in enumerate(self._backward_shards[parity]):
            shard[:size].copy_(parts[owner])
        self.comm.barrier()  # every member has written its parts
        pulled = self._pull(self._backward[parity][member])[:, :size]
        mine = pulled.float().sum(0) if pulled.dtype != torch.float32 else pulled.sum(0)
        return mine.to(grad.dtype).view(rows, *grad.shape[1:])

    def memory_bytes(self) -> int:
        held = self.comm.memory_bytes()
        return held["buffers"] + held["scheme"]

    def _buffers(self):
        return [*self._forward, *(b for parity in self._backward for b in parity)]

    def release(self) -> None:
        """Frees the buffers (collective over the members, after this rank's queued pulls);
        the sub-communicator stays."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.released = True
        self._forward_shards = self._backward_shards = None  # views first: free() refuses else
        for buffer in self._buffers():
            buffer.free()


class _GatherRows(torch.autograd.Function):
    """The members' rows gathered along dim 0, differentiable: the gradient returns to each
    member its rows' gradient summed over the members."""

    @staticmethod
    def forward(ctx, rows, exchange, member):
        ctx.exchange, ctx.member = exchange, member
        return exchange.all_gather(rows)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.reduce_scatter(grad, ctx.member), None, None


def _check_tiling(chunks: Sequence[Sequence[Tuple[int, int]]]) -> int:
    """The sample's length, if every member has tokens and the chunks tile the sample from
    token 0 (as a planner "splits" entry's do); else InvalidArgument naming the fault."""
    for member, chunk in enumerate(chunks):
        if not chunk or any(b >= e for b, e in chunk):
            raise InvalidArgument(
                f"odc.torch.split: member {member} of chunks {chunks} has no tokens or an empty "
                "piece: every member runs a non-empty chunk"
            )
    pieces = sorted(p for c in chunks for p in c)
    if pieces[0][0] != 0 or any(a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
        raise InvalidArgument(
            f"odc.torch.split: the chunks {chunks} do not tile a sample from token 0 (a planner "
            "'splits' entry's chunks do)"
        )
    return pieces[-1][1]


def _to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` without making the host wait: a copy from pageable memory would
    synchronize with the stream (and a chunk's index tensors are made once per chunk)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class SplitChunk:
    """This rank's part of one split sample: `member` (its index in the group), every member's
    [begin, end) token ranges of the sample (`chunks`, in member order) and the group's K/V
    exchange. This rank's tokens are the concatenation of `pieces` in order (`take`), at the
    sample's global positions (`positions`). Made by `SplitGroups.chunk`.

    Deliberately not a dataclass: it reaches every layer's attention as a forward argument, and
    FSDP2's mixed precision rebuilds every dataclass among forward inputs (dataclasses.replace,
    twice per module call); a rebuilt chunk loses its cached index tensors and rebuilds them on
    the host per layer (29,565 tokens: ~3 ms per layer and pass; docs/benchmarks-archive.md, seventh
    round)."""

    def __init__(self, exchange, member: int, chunks: Sequence[Sequence[Tuple[int, int]]]):
        self.exchange = exchange
        self.member = member
        self.chunks = [[(int(b), int(e)) for b, e in c] for c in chunks]
        self.length = _check_tiling(self.chunks)  # tokens of the sample
        if not 0 <= member < len(self.chunks):
            raise InvalidArgument(
                f"odc.torch.split: member {member} of a split with {len(self.chunks)} members"
            )

    @property
    def members(self) -> int:
        return len(self.chunks)

    @property
    def pieces(self) -> List[Tuple[int, int]]:
        return self.chunks[self.member]

    @property
    def num_tokens(self) -> int:
        return sum(e - b for b, e in self.pieces)

    @property
    def padded_tokens(self) -> int:
        """Rows each member contributes to an exchange (the group's longest chunk here)."""
        return max(sum(e - b for b, e in c) for c in self.chunks)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a per-token tensor of the whole sample (dim 0): input ids, or
        labels computed on the whole sample (so a piece's last token predicts the first token of
        the next piece, whoever holds it)."""
        if tensor.shape[0] != self.length:
            raise InvalidArgument(
                f"odc.torch.split: take: dim 0 holds {tensor.shape[0]} tokens, the sample "
                f"{self.length}"
            )
        return torch.cat([tensor[b:e] for b, e in self.pieces])

    def positions(self, device=None) -> torch.Tensor:
        """int64 [chunk tokens]: the sample's positions of this rank's tokens (for RoPE)."""
        device = device or torch.device("cpu")
        return torch.cat([torch.arange(b, e, device=device) for b, e in self.pieces])

    @functools.cached_property
    def _gather_index_list(self) -> List[int]:
        """For every token of the sample, in order, its row in the gathered buffer."""
        index = [0] * self.length
        rows = self.padded_tokens
        for member, chunk in enumerate(self.chunks):
            row = member * rows
            for begin, end in chunk:
                index[begin:end] = range(row, row + end - begin)
                row += end - begin
        return index

    def gather_index(self, device) -> torch.Tensor:
        """The sample's token order in the gathered rows, on `device`; made once per chunk."""
        cached = getattr(self, "_index_tensor", None)
        if cached is None or cached.device != torch.device(device):
            cached = _to_device(torch.tensor(self._gather_index_list, dtype=torch.long), device)
            self._index_tensor = cached
        return cached

    def varlen_offsets(self, device):
        """(cu_seqlens_q, cu_seqlens_k, max q, max k) of the pieces as varlen "documents",
        queries [b, e) against keys [0, e); made once per chunk, not once per layer."""
        cached = getattr(self, "_offsets", None)
        if cached is None or cached[0].device != torch.device(device):
            q_lens = [end - begin for begin, end in self.pieces]
            k_lens = [end for _, end in self.pieces]
            cu_q = _to_device(torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32), device)
            cu_k = _to_device(torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32), device)
            cached = (cu_q, cu_k, max(q_lens), max(k_lens))
            self._offsets = cached
        return cached

    def prefetch(self, device) -> None:
        """Makes the index tensors on `device` now (before a microbatch's clock starts, say)."""
        self.gather_index(device)
        self.varlen_offsets(device)

    def gather_sample(self, local: torch.Tensor) -> torch.Tensor:
        """[heads, chunk tokens, dim] of this member -> [heads, sample tokens, dim] of the whole
        sample in token order, differentiable. Every member must call it at the same point."""
        rows = local.transpose(0, 1)  # [chunk tokens, heads, dim]
        padding = self.padded_tokens - rows.shape[0]
        if padding:
            rows = F.pad(rows, (0, 0, 0, 0, 0, padding))
        gathered = _GatherRows.apply(rows, self.exchange, self.member)
        ordered = gathered.index_select(0, self.gather_index(gathered.device))
        return ordered.transpose(0, 1)


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch's varlen_attn (torch >= 2.10), or None; looked up once, not per attention call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def attention(query, key, value, chunk: SplitChunk, scale: Optional[float] = None):
    """Causal attention of this member's query tokens against the keys and values of the whole
    sample, gathered from the group, with the sample's global causal mask (token t sees 0..t).

    query [heads, chunk tokens, dim], key and value [kv heads, chunk tokens, dim] (grouped-query
    attention when kv heads divide heads); returns [heads, chunk tokens, dim]. Every member must
    call it at the same layers in the same order (forward and backward meet in the group). bf16
    or fp16 on CUDA with torch >= 2.10: torch's varlen flash attention; elsewhere SDPA with a
    mask (exact, slower). K and V travel together: one exchange per layer and direction."""
    if query.dim() != 3 or key.shape != value.shape or key.shape[1] != query.shape[1]:
        raise InvalidArgument(
            "odc.torch.split.attention: query [heads, tokens, dim] and key, value [kv heads, "
            f"tokens, dim] of the same tokens, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if query.shape[1] != chunk.num_tokens:
        raise InvalidArgument(
            f"odc.torch.split.attention: {query.shape[1]} query tokens, the chunk holds "
            f"{chunk.num_tokens}"
        )
    kv_heads = key.shape[0]
    kv_all = chunk.gather_sample(torch.cat([key, value], dim=0))
    k_all, v_all = kv_all[:kv_heads], kv_all[kv_heads:]  # [kv heads, L, dim] each
    if (
        query.device.type == "cuda"
        and _varlen_attn() is not None
        and query.dtype
        in (
            torch.bfloat16,
            torch.float16,
        )
    ):
        # One varlen "document" per piece: queries [b, e) against keys [0, e). Flash attention
        # aligns its causal mask to the bottom right when there are more keys than queries, so
        # query b + i sees keys 0..b + i: exactly the global causal mask.
        ends = [end for _, end in chunk.pieces]
        keys = torch.cat([k_all[:, :end] for end in ends], dim=1).transpose(0, 1)
        values = torch.cat([v_all[:, :end] for end in ends], dim=1).transpose(0, 1)
        cu_q, cu_k, max_q, max_k = chunk.varlen_offsets(query.device)
        out = _varlen_attn()(
            query.transpose(0, 1), keys, values, cu_q, cu_k, max_q, max_k,
            scale=scale, window_size=(-1, 0),
        )  # fmt: skip
        return out.transpose(0, 1)
    positions = chunk.positions(query.device)
    visible = torch.arange(chunk.length, device=query.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(
        query, k_all, v_all, attn_mask=visible, scale=scale, enable_gqa=True
    )


def use_transformers_attention(model) -> None:
    """Makes a Hugging Face transformers model (a `PreTrainedModel`, before or after
    `fully_shard`) run its attention through odc's: causal attention within each document of a
    packed sequence, and, for a split sample's chunk, `attention` above (K/V exchanged in the
    group). Registers odc's function in transformers' `AttentionInterface` (as "odc_packed") and
    selects it with the model's public `set_attn_implementation`. Then call the model with one
    packed sequence (input_ids [1, T]) and `**transformers_attention_kwargs(...)`. Local: no
    communication."""
    from .._packed_attention import ATTENTION_NAME, register_packed_attention

    select = getattr(model, "set_attn_implementation", None)
    if select is None:
        raise InvalidUsage(
            f"odc.torch.split.use_transformers_attention takes a transformers PreTrainedModel "
            f"with set_attn_implementation (transformers 4.56 or newer), got "
            f"{type(model).__name__}: pass the model itself (not a wrapper), or upgrade "
            "transformers"
        )
    register_packed_attention()
    select(ATTENTION_NAME)


def transformers_attention_kwargs(
    lengths: Optional[Sequence[int]] = None, *, chunk: Optional[SplitChunk] = None, device=None
) -> dict:
    """The keywords a model prepared by `use_transformers_attention` takes besides input_ids and
    position_ids: for a packed microbatch, the tokens of its documents in order (`lengths`:
    their boundaries, so no document attends to another); for this rank's chunk of a split
    sample, `chunk` (from `SplitGroups.chunk`). Exactly one of the two."""
    if (lengths is None) == (chunk is None):
        raise InvalidArgument(
            "odc.torch.split.transformers_attention_kwargs: pass the packed documents' lengths "
            "or a split chunk, exactly one"
        )
    if chunk is not None:
        return {"odc_split": chunk}
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise InvalidArgument(
            f"odc.torch.split.transformers_attention_kwargs: lengths must be positive token "
            f"counts, one per packed document, got {lengths}"
        )
    boundaries = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device=device)
    longest = max(lengths)
    return {
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _disjoint_rounds(groups: Sequence[Tuple[int, ...]]) -> List[List[Tuple[int, ...]]]:
    """`groups` in rounds of pairwise disjoint member sets, greedily in order: one Comm.split
    makes a whole round (each rank has one colour per split)."""
    rounds: List[Tuple[set, List[Tuple[int, ...]]]] = []
    for members in groups:
        for used, round_groups in rounds:
            if used.isdisjoint(members):
                used.update(members)
                round_groups.append(members)
                break
        else:
            rounds.append((set(members), [members]))
    return [round_groups for _, round_groups in rounds]


class SplitGroups:
    """The groups of a run's split samples, made once per distinct set of members, and their K/V
    exchanges (module docstring).

    exchange="odc": `comm` is the job's odc communicator over the planner's ranks (rank r of the
    plan is rank r of comm: a flat mesh, comm_from_process_group() or odc.Comm); `kv_width` is
    the elements per token of K and V together (2 x key/value heads x head dim) and `dtype` the
    dtype attention computes in. Sub-communicators need the shm or cuda transport (one host).
    exchange="process-group": torch.distributed subgroups of the default group, whose rank r is
    rank r of the plan; `engines` (OdcFSDP engines) are told that the groups meet inside their
    minibatches by design (allow_collectives), so their collectives check leaves them out.

    Close it (or use it as a context manager) after the last split ran, on every rank."""

    def __init__(
        self,
        comm=None,
        *,
        exchange: str = "odc",
        kv_width: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        engines: Sequence = (),
    ) -> None:
        import torch.distributed as dist

        if exchange not in _EXCHANGES:
            raise InvalidArgument(
                f"odc.torch.split: exchange must be one of {', '.join(_EXCHANGES)}, got "
                f"{exchange!r}"
            )
        if exchange == "odc":
            if comm is None:
                raise InvalidArgument("odc.torch.split: exchange 'odc' needs the job's odc comm")
            if isinstance(kv_width, bool) or not isinstance(kv_width, int) or kv_width < 1:
                raise InvalidArgument(
                    "odc.torch.split: exchange 'odc' needs kv_width, the elements per token of "
                    f"K and V together (2 x key/value heads x head dim), got {kv_width!r}"
                )
            if dtype not in (torch.float32, torch.bfloat16):
                raise InvalidArgument(
                    f"odc.torch.split: exchange 'odc' moves float32 or bfloat16, not {dtype}"
                )
            self.rank, self.world_size = comm.rank, comm.world_size
        else:
            if not dist.is_initialized():
                raise InvalidUsage(
                    "odc.torch.split: exchange 'process-group' needs torch.distributed "
                    "initialized (init_process_group)"
                )
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.exchange, self.comm, self.kv_width, self.dtype = exchange, comm, kv_width, dtype
        self.engines = list(engines)
        # members -> this rank's group, in creation order (the same on every rank): an odc
        # sub-communicator or a torch.distributed subgroup exchange
        self._members: Dict[Tuple[int, ...], object] = {}
        self._held: Dict[Tuple[int, ...], "_OdcExchange"] = {}  # odc groups holding buffers
        self._counters: Dict[Tuple[int, ...], dict] = {}  # members -> counts over all buffers
        self._prepared: Dict[Tuple[int, ...], int] = {}  # members -> rows of the last prepare()
        self.peak_bytes = 0  # the most memory_bytes() after any prepare()
        self._closed = False

    def __enter__(self) -> "SplitGroups":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def prepare(self, splits: Sequence[dict]) -> None:
        """Collective over every rank (the same `splits`, in the same order): readies the
        groups of `splits` (planner "splits" entries) for their chunks. A distinct member set
        gets its group once (an odc sub-communicator, or a torch.distributed subgroup that meets
        once here, so that no minibatch pays its first meeting: NCCL ~0.25 s on 4 H200s,
        docs/benchmarks-archive.md, seventh round). With the odc exchange, buffers are held for
        these splits' groups only, sized for their longest chunks: other groups' are freed, a group
        whose chunks grew (or shrank below half) gets new ones. Call it before each minibatch
        with its splits (least memory), or once with every split of the run (no later cost)."""
        needs = self.connect(splits)
        if self.exchange == "odc":
            self._hold_buffers(needs)
            self.peak_bytes = max(self.peak_bytes, self.memory_bytes())
        self._prepared = needs

    def connect(self, splits: Sequence[dict]) -> Dict[Tuple[int, ...], int]:
        """Collective over every rank (the same `splits`, in the same order): makes the groups
        of `splits` that do not exist yet, without buffers (prepare() does this too). Connect
        every split of a run up front to keep the groups' making out of its minibatches.
        Returns {members: the longest chunk's tokens}."""
        if self._closed:
            raise InvalidUsage("odc.torch.split: prepare() or connect() after close()")
        needs: Dict[Tuple[int, ...], int] = {}
        for entry in splits:
            members, rows = self._check_entry(entry)
            needs[members] = max(needs.get(members, 0), rows)
        new = [m for m in needs if m not in self._members]
        for members in new:  # creation order, the same on every rank (members or not)
            self._members[members] = None
        if self.exchange == "odc":
            self._make_sub_communicators(new)
        else:
            self._make_process_groups(new)
        return needs

    def _check_entry(self, entry: dict) -> Tuple[Tuple[int, ...], int]:
        try:
            members = tuple(int(r) for r in entry["ranks"])
            chunks = [[(int(b), int(e)) for b, e in c] for c in entry["chunks"]]
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidArgument(
                f"odc.torch.split: a split entry holds 'ranks' and 'chunks' (the planner's "
                f"'splits'), got {entry!r} ({error})"
            ) from None
        if len(members) < 2 or len(set(members)) != len(members) or len(chunks) != len(members):
            raise InvalidArgument(
                f"odc.torch.split: a split needs 2 or more distinct ranks and one chunk each, got "
                f"ranks {list(members)} and {len(chunks)} chunks"
            )
        if not all(0 <= r < self.world_size for r in members):
            raise InvalidArgument(
                f"odc.torch.split: ranks {list(members)} outside the job's {self.world_size}"
            )
        _check_tiling(chunks)  # on every rank, so that all refuse together
        return members, max(sum(e - b for b, e in c) for c in chunks)

    def _make_sub_communicators(self, new: List[Tuple[int, ...]]) -> None:
        for round_groups in _disjoint_rounds(new):
            colour = next((i for i, m in enumerate(round_groups) if self.rank in m), None)
            members = round_groups[colour] if colour is not None else None
            key = members.index(self.rank) if members else None
            try:
                sub = self.comm.split(colour, key=key)
            except InvalidUsage as error:  # the transport cannot split (NVSHMEM)
                raise InvalidUsage(
                    f"{error} (odc.torch.split: the 'odc' K/V exchange needs sub-communicators; "
                    "use exchange='process-group', odc.train's --kv-exchange nccl)"
                ) from None
            if sub is None:
                continue
            if sub.world_size != len(members):
                sub.close()
                raise InvalidUsage(
                    f"odc.torch.split: rank {self.rank}: the group of ranks {list(members)} "
                    f"formed with {sub.world_size} members: ranks passed different splits to "
                    "prepare()"
                )
            self._members[members] = sub

    def _hold_buffers(self, needs: Dict[Tuple[int, ...], int]) -> None:
        """Frees the buffers of groups not in `needs` (or sized far from it), then allocates for
        the groups in `needs` lacking them; each collective over a group's members, walked in
        creation order on every rank, so no two groups wait on each other."""
        for members in [m for m in self._members if m in self._held]:
            rows = self._held[members].rows
            if members not in needs or not needs[members] <= rows <= 2 * needs[members]:
                self._held.pop(members).release()
        for members, sub in self._members.items():
            if members in needs and sub is not None and members not in self._held:
                counters = self._counters.setdefault(
                    members, {"forward": 0, "backward": 0, "elements_pulled": 0}
                )
                self._held[members] = _OdcExchange(
                    sub, needs[members], self.kv_width, self.dtype, counters
                )

    def _make_process_groups(self, new: List[Tuple[int, ...]]) -> None:
        import torch.distributed as dist

        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        for members in new:  # every rank makes every group, in order (new_group requires it)
            group = dist.new_group(list(members))
            if self.rank not in members:
                continue
            dist.all_reduce(torch.zeros(1, device=device), group=group)  # its first meeting
            for engine in self.engines:
                engine.allow_collectives(group)
            self._members[members] = _ProcessGroupExchange(group, members)

    def chunk(self, entry: dict) -> Optional[SplitChunk]:
        """This rank's chunk of the split `entry` (one of the last prepare()'s entries), or
        None where this rank is not one of its members."""
        if self._closed:
            raise InvalidUsage("odc.torch.split: chunk() after close()")
        members, rows = self._check_entry(entry)
        if self.rank not in members:
            return None
        if rows > self._prepared.get(members, 0):
            raise InvalidUsage(
                f"odc.torch.split: the split over ranks {list(members)} ({rows} rows) is not "
                "among the last prepare()'s splits: prepare() each minibatch's splits (or all "
                "of the run's) first, on every rank"
            )
        group = self._held[members] if self.exchange == "odc" else self._members[members]
        return SplitChunk(group, members.index(self.rank), entry["chunks"])

    def memory_bytes(self) -> int:
        """Bytes of odc symmetric memory the K/V exchanges hold on this rank now (0 with
        process groups: NCCL's own buffers are not counted)."""
        return sum(group.memory_bytes() for group in self._held.values())

    def stats(self) -> Dict[Tuple[int, ...], dict]:
        """Per group this rank belongs to: members, exchanges made ("forward", "backward") and,
        for the odc exchange, the elements this rank gathered (k shards per exchange), over
        every prepare() so far."""
        out = {}
        for members, group in self._members.items():
            if isinstance(group, _ProcessGroupExchange):
                out[members] = {"members": len(members), **group.uses}
            elif group is not None:  # an odc sub-communicator
                counts = self._counters.get(members, {"forward": 0, "backward": 0})
                out[members] = {"members": len(members), **counts}
        return out

    def close(self) -> None:
        """Frees the odc buffers and closes the sub-communicators (collective over each group's
        members, in creation order); idempotent. torch.distributed subgroups stay (torch
        destroys them with the default group)."""
        if self._closed:
            return
        self._closed = True
        for members in [m for m in self._members if m in self._held]:
            self._held.pop(members).release()
        for group in self._members.values():
            if group is not None and not isinstance(group, _ProcessGroupExchange):
                group.close()
        self._members.clear()
