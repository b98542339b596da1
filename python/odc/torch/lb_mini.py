"""LB-Mini from a sampler loop: each rank holds only its own samples of the step (a
`DistributedSampler`'s share). `lb_mini_step` gathers their lengths once, runs the same
`odc.plan(policy="lb-mini")` on every rank and says which samples each rank runs, in which
microbatches; `LbMiniStep.exchange` moves the samples themselves there (one all-to-all).

Invariant: every rank plans from the same gathered lengths with the same deterministic planner, so
every rank holds the same `LbMiniStep` (but `rank`) and every sample of the step runs exactly once.
Both collectives here run outside any odc minibatch: a collective inside one can hang
(docs/torch.md, "Collectives and minibatches").
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import InvalidArgument
from ..planner import microbatch_cost
from ..planner import plan as odc_plan
from ._all_to_all import all_to_all_objects, to_device


@dataclass(frozen=True)
class LbMiniStep:
    """One step's LB-Mini plan over every rank's local samples, the same on every rank.

    Samples have global ids: rank 0's local samples first, in its order, then rank 1's, and so
    on (`origins[g]` = (rank, local position) of global sample g). Every rank's microbatches and
    their predicted costs are here, not only this rank's, so a scheduler that lets ranks run
    other ranks' microbatches (work stealing) can take them as they are.
    """

    rank: int
    num_ranks: int
    lengths: List[int]  # tokens of every sample of the step, by global id
    keys: List[Any]  # the caller's key of every sample (e.g. its dataset index), by global id
    origins: List[Tuple[int, int]]  # (rank, local position) of every sample, by global id
    microbatches_by_rank: List[List[List[int]]]  # [rank][microbatch] -> global ids
    costs_by_rank: List[List[float]]  # [rank][microbatch] -> its predicted cost (plan's model)
    plan: dict  # odc.plan's document (one minibatch)

    @property
    def microbatches(self) -> List[List[int]]:
        """This rank's microbatches, as lists of global sample ids."""
        return self.microbatches_by_rank[self.rank]

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole step on all ranks (odc.torch.scale_loss's global count)."""
        return sum(self.lengths)

    def keys_of(self, microbatches: Sequence[Sequence[int]]) -> List[List[Any]]:
        """The caller's keys (dataset indices) of the given microbatches' samples: with keys,
        a rank can load its samples itself instead of receiving them (`exchange`)."""
        return [[self.keys[g] for g in microbatch] for microbatch in microbatches]

    def exchange(self, local_samples: Sequence[Any], group=None) -> List[List[Any]]:
        """Collective over the group the step was planned on, outside any odc minibatch: every
        rank passes its own samples (as many as the lengths it gave, in the same order; any
        object torch.save takes: tensors, dicts of tensors); returns this rank's microbatches
        with their samples. One all-to-all of serialized samples, after one of byte counts;
        samples that stay on this rank are not copied. Received tensors come to where this
        rank's first local tensor sample lives (else the CPU)."""
        if dist.get_world_size(group) != self.num_ranks or dist.get_rank(group) != self.rank:
            raise InvalidArgument(
                f"exchange runs on the group the step was planned on ({self.num_ranks} ranks, "
                f"this one rank {self.rank}); got a group of {dist.get_world_size(group)} "
                f"ranks where this one is rank {dist.get_rank(group)}"
            )
        local_count = sum(1 for source, _ in self.origins if source == self.rank)
        problem = None
        if len(local_samples) != local_count:
            problem = (
                f"rank {self.rank} passed {len(local_samples)} samples to exchange but planned "
                f"{local_count}: pass this rank's samples in the order of the lengths it gave "
                "lb_mini_step"
            )
        runs_on = [0] * len(self.lengths)
        for rank, microbatches in enumerate(self.microbatches_by_rank):
            for microbatch in microbatches:
                for g in microbatch:
                    runs_on[g] = rank
        outgoing: List[Optional[dict]] = [None] * self.num_ranks
        if problem is None:
            for g, (source, position) in enumerate(self.origins):
                if source == self.rank and runs_on[g] != self.rank:
                    outgoing[runs_on[g]] = outgoing[runs_on[g]] or {}
                    outgoing[runs_on[g]][g] = local_samples[position]
        incoming = all_to_all_objects(
            outgoing, group, problem=problem, what="exchange",
            peer_problem="passed a wrong number of samples",
        )  # fmt: skip
        device = next(
            (s.device for s in local_samples if isinstance(s, torch.Tensor)), torch.device("cpu")
        )
        received = {}
        for part in incoming:
            for g, sample in (part or {}).items():
                received[g] = to_device(sample, device)
        for g, (source, position) in enumerate(self.origins):
            if source == self.rank and runs_on[g] == self.rank:
                received[g] = local_samples[position]
        return [[received[g] for g in microbatch] for microbatch in self.microbatches]


def lb_mini_step(
    local_lengths: Sequence[int],
    max_tokens: int,
    *,
    keys: Optional[Sequence[Any]] = None,
    group=None,
    cost: Sequence[float] = (1.0, 0.0, 0.0),
    rank_speed: Optional[Sequence[float]] = None,
    microbatch_memory: str = "lb-micro",
) -> LbMiniStep:
    """Collective over `group` (default: the world), outside any odc minibatch: plans one step
    whose samples are spread over the ranks, each rank passing only its own.

    local_lengths: tokens of this rank's samples of the step (a rank may have none).
    keys: optional, one per local sample (e.g. the dataset indices a DistributedSampler gave):
        returned for every sample (`LbMiniStep.keys`, `keys_of`), so ranks can load what they
        run themselves; default: the global ids.
    max_tokens, cost, rank_speed, microbatch_memory: as odc.plan; they must be equal on every
        rank (checked: every rank raises the same error).

    One all_gather_object of (lengths, keys, options), then odc.plan(policy="lb-mini",
    samples_per_rank=None) on all gathered lengths: the result is the same on every rank. Bad
    input (a length that is not a positive integer, options differing between ranks) raises the
    same odc.InvalidArgument on every rank, after the gather, so no rank is left waiting.
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(local_lengths, torch.Tensor):
        local_lengths = local_lengths.tolist()
    options = (max_tokens, tuple(cost), None if rank_speed is None else tuple(rank_speed))
    options += (microbatch_memory,)
    local_keys = None if keys is None else list(keys)
    gathered: List[Any] = [None] * num_ranks
    dist.all_gather_object(gathered, (list(local_lengths), local_keys, options), group=group)

    for r, (_, _, theirs) in enumerate(gathered):
        if theirs != options:
            raise InvalidArgument(
                f"lb_mini_step: rank {r} planned with (max_tokens, cost, rank_speed, "
                f"microbatch_memory) = {theirs}, rank {rank} with {options}: pass the same "
                "values on every rank"
            )
    lengths, all_keys, origins = [], [], []
    for r, (their_lengths, their_keys, _) in enumerate(gathered):
        if their_keys is not None and len(their_keys) != len(their_lengths):
            raise InvalidArgument(
                f"lb_mini_step: rank {r} gave {len(their_keys)} keys for {len(their_lengths)} "
                "samples: pass one key per sample, or none"
            )
        for position, length in enumerate(their_lengths):
            if isinstance(length, bool) or not isinstance(length, numbers.Integral):
                raise InvalidArgument(
                    f"lb_mini_step: rank {r}'s sample {position} has length {length!r}: "
                    "lengths are token counts (integers)"
                )
            all_keys.append(len(lengths) if their_keys is None else their_keys[position])
            lengths.append(int(length))
            origins.append((r, position))
    if not lengths:
        raise InvalidArgument("lb_mini_step: no rank has a sample in this step")

    planned = odc_plan(
        lengths,
        ranks=num_ranks,
        max_tokens=max_tokens,
        policy="lb-mini",
        samples_per_rank=None,
        cost=cost,
        rank_speed=rank_speed,
        microbatch_memory=microbatch_memory,
    )
    (minibatch,) = planned["minibatches"]
    microbatches = [rank_plan["microbatches"] for rank_plan in minibatch["ranks"]]
    costs = [[microbatch_cost(m, lengths, cost) for m in mine] for mine in microbatches]
    return LbMiniStep(rank, num_ranks, lengths, all_keys, origins, microbatches, costs, planned)
