"""One rank of a GRPO training-phase run (`python -m odc.train --task grpo`): per RL
step, (a) old log-probabilities and entropy on the policy, forward only; (b) reference
log-probabilities on a frozen copy of the initial policy, forward only; (c) the actor update over
K minibatches: PPO clipped 0.2 low / 0.28 high, the loss summed over response tokens and divided
by the minibatch's response tokens on all ranks, an optional KL to the reference, clipping at
1.0, AdamW. Rewards are synthetic (no verifier: grpo.synthetic_rewards), the arithmetic is real.

Under ODC the forward-only phases run inside forward-only minibatches (gathers only, any number
of microbatches per rank); under collective FSDP2 every rank runs the same number of forwards
(LB-Micro pads). The planner plans the forward-only phases with the cost model scaled to a
forward (FORWARD_FRACTION of forward + backward) and the update minibatches with the full cost.
The update minibatches are Run.step's, timed and summarized as SFT's are.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..errors import InvalidArgument
from . import grpo
from .run import Run, RunConfig, drive

# A forward's share of forward + backward in the fitted cost model: backward costs about twice a
# forward; with activation checkpointing the forward runs again in backward (1 / 4).
FORWARD_FRACTION = {False: 1 / 3, True: 1 / 4}


@dataclass
class RlConfig:
    rollouts: List[grpo.Rollout]  # e.g. grpo.read_rollouts("data/grpo_math_like.tsv")
    prompts_per_step: int = 8  # groups per RL step
    minibatches_per_step: int = 2  # K actor-update minibatches per RL step
    kl_coef: float = 0.0  # the KL-to-reference term's weight (0: none; the reference still runs)
    reward_seed: int = 0


class GrpoRun(Run):
    """Run with GRPO's phases (module docstring); `config.lengths` are the rollouts' lengths."""

    def __init__(self, rank, world_size, key, config: RunConfig, rl: RlConfig):
        if config.split != "off":
            raise InvalidArgument("--task grpo does not split samples yet: drop --split")
        super().__init__(rank, world_size, key, config)
        self.rl = rl
        self.rollouts = rl.rollouts
        if [r.length for r in self.rollouts] != list(config.lengths):
            raise InvalidArgument("RunConfig.lengths must be the rollouts' lengths")
        self.phase_seconds: List[dict] = []

    def setup(self) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        super().setup()
        self.reference, self.reference_engine = self._reference_model()
        for model in (self.model, self.reference):  # FSDP2 gathers the root for it too
            register_fsdp_forward_method(model, "token_logprobs")

    def _reference_model(self):
        """The frozen reference: the initial policy (same preset and seed), sharded like it;
        under ODC its own engine over a sub-communicator of the run's (one engine per comm)."""
        import odc.torch

        model, _, _ = self._sharded_model()
        model.requires_grad_(False)
        if self.comm is None:
            return model, None
        self.reference_comm = self.comm.split(0)  # every rank: the whole run, a comm of its own
        return model, odc.torch.OdcFSDP(model, self.reference_comm)

    # -- plan ----------------------------------------------------------------------------------
    def plan(self) -> None:
        """The cost model, then per RL step: one forward-only plan over the step's rollouts
        (forward cost) and the update plan of its K minibatches (full cost)."""
        super().plan()  # the fitted cost (and the SFT plan of the lengths, unused here)
        steps = grpo.rl_steps(self.rollouts, self.rl.prompts_per_step, self.rl.minibatches_per_step)
        if not steps:
            raise InvalidArgument(
                f"{len(self.rollouts)} rollouts hold no RL step of {self.rl.prompts_per_step} prompts"
            )
        # --steps counts RL steps, the first warmup_steps of them unmeasured: in update
        # minibatches (what Run.step and the summary count), K per RL step.
        steps = steps[: self.config.steps + self.config.warmup_steps]
        self.config = dataclasses.replace(
            self.config, warmup_steps=self.config.warmup_steps * self.rl.minibatches_per_step
        )
        self.rl_steps = []
        for minibatches in steps:
            if len({len(mb) for mb in minibatches}) != 1:
                raise InvalidArgument(
                    "an RL step's minibatches hold different numbers of rollouts (groups of "
                    "different sizes): every group needs the same number of responses"
                )
            indices = [i for mb in minibatches for i in mb]
            self.rl_steps.append((indices, *self._step_plans(indices, len(minibatches[0]))))
        # The update minibatches as Run.step runs them: one plan over every step's minibatches,
        # its sample indices the rollouts' (global).
        minibatches = []
        for indices, _, update in self.rl_steps:
            for minibatch in update["minibatches"]:
                minibatches.append(_remap(minibatch, indices))
        self.schedule = {"minibatches": minibatches, "cost": self.rl_steps[0][2]["cost"]}
        self.num_steps = len(minibatches)
        self.old, self.ref, self.advantages = {}, {}, {}

    def _step_plans(self, indices: List[int], per_minibatch: int):
        """(forward-only plan of the whole step, update plan of its minibatches), as the arm
        runs them (arms.adapt_plan: padding for lb-mini-padded and fsdp2-unsharded)."""
        from .arms import adapt_plan, planner_policy
        from .data import schedule

        config = self.config
        forward_cost = _forward_costs(self.cost, config.activation_checkpointing)
        lengths = [self.rollouts[i].length for i in indices]
        plans = []
        for size, cost in ((len(indices), forward_cost), (per_minibatch, self.cost)):
            planned = schedule(
                lengths, ranks=self.world_size, samples_per_minibatch=size,
                max_tokens=config.max_tokens, policy=planner_policy(config.policy), cost=cost,
                microbatch_memory=config.microbatch_memory,
            )  # fmt: skip
            plans.append(adapt_plan(planned, config.comm, config.policy))
        return plans

    # -- steps ---------------------------------------------------------------------------------
    def step(self, step: int):
        """An update minibatch (Run.step); the first of each RL step runs the step's forward-only
        phases first (timed apart: self.phase_seconds)."""
        if step % self.rl.minibatches_per_step == 0:
            self._forward_phases(step // self.rl.minibatches_per_step)
        return super().step(step)

    def _global_tokens(self, minibatch: dict) -> int:
        """The loss normalization: the minibatch's response tokens on all ranks."""
        return sum(self.rollouts[i].response_tokens for i in minibatch["samples"])

    def _forward_phases(self, rl_step: int) -> None:
        import torch.distributed as dist

        indices, forward, _ = self.rl_steps[rl_step]
        (plan,) = forward["minibatches"]
        # Every rank's forward microbatches, by rollout index (the work board needs them all).
        queues = [[[indices[i] for i in mb] for mb in r["microbatches"]] for r in plan["ranks"]]
        seconds = {}
        for name, model, engine in (
            ("old_logprobs", self.model, self.engine),
            ("ref_logprobs", self.reference, self.reference_engine),
        ):
            self.clock.sync()
            dist.barrier()
            begin = time.perf_counter()
            found = self._forward_only(model, engine, queues)
            self.clock.sync()
            seconds[name] = time.perf_counter() - begin
            store = self.old if name == "old_logprobs" else self.ref
            store.clear()
            begin = time.perf_counter()
            # To the host in one copy, then every rank's samples to every rank (the update's
            # assignment places rollouts on other ranks): both part of the exchange.
            store.update(_all_ranks(_to_host(found)))
            seconds[name + "_exchange"] = time.perf_counter() - begin
        # The policy's mean entropy over the step's response tokens (what RL runs log).
        responses = sum(self.rollouts[i].response_tokens for i in indices)
        seconds["entropy"] = float(sum(self.old[i][1].sum() for i in indices) / responses)
        rewards = grpo.synthetic_rewards([self.rollouts[i] for i in indices], self.rl.reward_seed)
        groups = [self.rollouts[i].group for i in indices]
        self.advantages = dict(zip(indices, grpo.group_advantages(rewards, groups)))
        self.phase_seconds.append(seconds)

    def _forward_only(self, model, engine, queues) -> dict:
        """{rollout: (log-probs, entropy) of its tokens, on the device} for this rank's forward
        microbatches (queues: every rank's, by rollout index; with stealing, the work board's
        claims decide which this rank runs: the exchange after it sends every rank's results to
        every rank, so who computed one does not matter). Nothing is read back here: a copy to
        the host per rollout would stall the host once per microbatch inside the timed phase (it
        only enqueues, as in training)."""
        import torch

        found = {}
        # odc: a forward-only minibatch (gathers, no pushes); fsdp2-unsharded: every unit
        # gathered once around it (arms.GradientSync.forward_only); else FSDP2 as is.
        scope = engine.minibatch() if engine is not None else self.sync.forward_only(model)
        with scope, torch.no_grad():
            if self.config.steal:
                cost = _forward_costs(self.cost, self.config.activation_checkpointing)
                microbatches = engine.microbatches(queues, lengths=self.sample_lengths, cost=cost)
            else:
                microbatches = queues[self.rank]
            for microbatch in microbatches:
                packed, labels = self._packed(microbatch)
                t = self.trainer._to_device
                logp, entropy = model.token_logprobs(
                    t(packed.input_ids), t(packed.position_ids), labels,
                    t(packed.boundaries), packed.longest,
                )  # fmt: skip
                for i, (begin, end) in zip(microbatch, _spans(packed)):
                    found[i] = (logp[begin:end], entropy[begin:end])
        return found

    def _packed(self, microbatch):
        """The packed rollouts and their response-only labels (on the device)."""
        from .data import pack

        packed = pack([self.samples[i] for i in microbatch])
        labels = packed.labels.copy()
        for i, (begin, end) in zip(microbatch, _spans(packed)):
            labels[begin : begin + self.rollouts[i].prompt_tokens - 1] = grpo.IGNORE_INDEX
        return packed, self.trainer._to_device(labels)

    def _microbatch(self, microbatch: list, global_tokens: int, detail: Optional[dict] = None):
        """One update microbatch: the clipped objective on the response tokens (Run._timed).
        An empty (padding) microbatch runs as Run's: one token, no loss term."""
        if not microbatch:
            return super()._microbatch(microbatch, global_tokens, detail)

        packed, labels = self._packed(microbatch)
        self.probe.enter("microbatch", packed.num_tokens)
        device = self.trainer._to_device  # numpy -> this rank's device, without a host wait

        def per_token(table):  # a forward phase's per-token arrays, in the microbatch's order
            return device(np.concatenate([table[i][0] for i in microbatch]).astype(np.float32))

        advantages = np.concatenate(
            [np.full(self.rollouts[i].length, self.advantages[i], np.float32) for i in microbatch]
        )
        objective = grpo.ppo_objective(
            per_token(self.old), device(advantages), per_token(self.ref), self.rl.kl_coef
        )
        detail = {**(detail or {}), "lengths": [self.rollouts[i].length for i in microbatch]}
        return self._timed(packed, global_tokens, detail, objective=objective, labels=labels)

    def _planned_microbatch_tokens(self) -> List[int]:
        """The update microbatches' token counts (Run's), and the forward-only passes'."""
        tokens = super()._planned_microbatch_tokens()
        for indices, forward, _ in self.rl_steps:
            for minibatch in forward["minibatches"]:
                for rank in minibatch["ranks"]:
                    for microbatch in rank["microbatches"]:
                        tokens.append(sum(self.rollouts[indices[i]].length for i in microbatch))
        return tokens

    def _compile_forward_only(self, packed: list) -> None:
        """Policy and reference, forward only at each size, as _forward_only runs them."""
        import torch

        t = self.trainer._to_device
        for model, engine in ((self.model, self.engine), (self.reference, self.reference_engine)):
            scope = engine.minibatch() if engine is not None else self.sync.forward_only(model)
            with scope, torch.no_grad():
                for microbatch in packed:
                    model.token_logprobs(
                        t(microbatch.input_ids), t(microbatch.position_ids), t(microbatch.labels),
                        t(microbatch.boundaries), microbatch.longest,
                    )  # fmt: skip

    def _predicted_forward_seconds(self) -> List[float]:
        """Per planned RL step, the planner's span of its forward-only minibatch (metrics'
        accounting under the arm's prediction mode, with the forward cost)."""
        from .arms import prediction_mode
        from .metrics import predict_minibatch

        cost = _forward_costs(self.cost, self.config.activation_checkpointing)
        lengths = [r.length for r in self.rollouts]
        spans = []
        for indices, forward, _ in self.rl_steps:
            (plan,) = forward["minibatches"]
            ranks = _remap(plan, indices)["ranks"]
            spans.append(
                predict_minibatch(
                    ranks, lengths, cost, prediction_mode(self.config.comm, self.config.steal)
                ).span_seconds
            )
        return spans

    # -- collect -------------------------------------------------------------------------------
    def collect(self) -> Optional[dict]:
        import torch.distributed as dist

        phases = [None] * self.world_size
        dist.all_gather_object(phases, self.phase_seconds)
        summary = super().collect()
        if self.reference_engine is not None:
            self.reference_comm.close()
        if summary is None:
            return None
        summary["task"] = "grpo"
        summary["rl"] = {
            "prompts_per_step": self.rl.prompts_per_step,
            "minibatches_per_step": self.rl.minibatches_per_step,
            "kl_coef": self.rl.kl_coef,
            "rollouts_per_step": len(self.rl_steps[0][0]),  # what the forward-only phases plan
            # Per RL step, the planner's seconds for one forward-only phase (the same plan runs
            # twice: policy and reference), under the arm's prediction mode, as for updates.
            "predicted_phase_seconds": self._predicted_forward_seconds(),
            # Per RL step, each forward-only phase's seconds on the slowest rank.
            "phase_seconds": [
                {k: max(p[s][k] for p in phases) for k in phases[0][s] if k != "entropy"}
                for s in range(len(phases[0]))
            ],
            "entropy": [p["entropy"] for p in phases[0]],  # the same on every rank
        }
        return summary


def _forward_costs(cost, activation_checkpointing: bool) -> tuple:
    """The cost model of a forward alone: every term (floor included) scaled by FORWARD_FRACTION."""
    scale = FORWARD_FRACTION[activation_checkpointing]
    return tuple(term * scale for term in cost)


def _spans(packed):
    """[begin, end) of each document of a packed microbatch."""
    bounds = packed.boundaries.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _to_host(found: dict) -> dict:
    """{rollout: (log-probs, entropy)} as numpy arrays, through one device-to-host copy."""
    import torch

    if not found:
        return {}
    order = list(found)
    sizes = [found[i][0].numel() for i in order]
    host = torch.cat([torch.cat([found[i][0], found[i][1]]) for i in order]).cpu().numpy()
    arrays, offset = {}, 0
    for i, size in zip(order, sizes):
        arrays[i] = (host[offset : offset + size], host[offset + size : offset + 2 * size])
        offset += 2 * size
    return arrays


def _remap(minibatch: dict, indices: List[int]) -> dict:
    """A plan minibatch over a step's rollouts, its sample indices the rollouts' own."""
    ranks = [
        {**rank, "microbatches": [[indices[i] for i in mb] for mb in rank["microbatches"]]}
        for rank in minibatch["ranks"]
    ]
    return {**minibatch, "samples": [indices[i] for i in minibatch["samples"]], "ranks": ranks}


def _all_ranks(found: dict) -> dict:
    """Every rank's {rollout: arrays}, merged (host objects through the process group)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def run_grpo_rank(rank: int, world_size: int, key, config: RunConfig, rl: RlConfig):
    """One rank of a GRPO run (run.run_rank's counterpart): the summary on rank 0."""
    return drive(GrpoRun(rank, world_size, key, config, rl))
