"""The arms `odc.train` measures (docs/train.md "Arms"): how each communication mode
shards the model, when it synchronizes gradients, and which plans it can run. Every arm trains the
same summed gradients; they differ in time and memory only.

  collective       FSDP2 as built: all-gather per layer per microbatch, reduce-scatter per layer per
                   microbatch. Equal microbatch counts on every rank.
  fsdp2-deferred   FSDP2 with gradient sync deferred to the last microbatch (verl's default): the
                   per-layer all-gathers stay, one reduce-scatter per layer per minibatch; unsharded
                   fp32 gradients held between microbatches. Equal counts.
  fsdp2-unsharded  FSDP2 with resharding off after forward and backward and sync deferred: one
                   all-gather per layer at the minibatch's start, one reduce-scatter per layer in the
                   last backward, nothing in between, so counts may differ; unsharded parameters and
                   fp32 gradients held through the minibatch.
  odc              ODC: no collective inside the minibatch; counts may differ.

Invariant: under every FSDP2 arm every rank enters the same FSDP2 collectives in the same order in
every minibatch, whatever its microbatch count (checked by tests/python/test_train_arms.py).
"""

from __future__ import annotations

import contextlib
import copy

from ..errors import InvalidArgument

COMMS = ("collective", "fsdp2-deferred", "fsdp2-unsharded", "odc")
POLICIES = ("local-sort", "lb-micro", "lb-mini", "lb-mini-padded")
# The comms whose ranks may run different numbers of microbatches in one minibatch.
UNEQUAL_COUNTS = ("fsdp2-unsharded", "odc")


def planner_policy(policy: str) -> str:
    """The planner's policy for `policy`: lb-mini-padded is LB-Mini's plan, padded afterwards."""
    return "lb-mini" if policy == "lb-mini-padded" else policy


def prediction_mode(comm: str, steal: bool = False) -> str:
    """How the planner predicts an arm's span (metrics.predict_minibatch): "collective" where
    ranks meet per microbatch (collective, fsdp2-deferred: the per-layer all-gathers of every
    microbatch), "odc" (max over ranks of their summed costs) where they meet only at the
    minibatch's edges (fsdp2-unsharded, odc), "odc-steal" for ODC with work stealing (the
    planner's model of the work board's claims)."""
    if steal and comm == "odc":
        return "odc-steal"
    return "odc" if comm in UNEQUAL_COUNTS else "collective"


def check_arm(comm: str, policy: str) -> None:
    """Raises InvalidArgument for a comm x policy that cannot run."""
    if comm not in COMMS:
        raise InvalidArgument(f"comm must be one of {', '.join(COMMS)}, got {comm!r}")
    if policy not in POLICIES:
        raise InvalidArgument(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "lb-mini" and comm not in UNEQUAL_COUNTS:
        raise InvalidArgument(
            f"lb-mini gives ranks different microbatch counts, which {comm} cannot run"
        )


def adapt_plan(plan: dict, comm: str, policy: str) -> dict:
    """The plan an arm runs, from the planner's (a copy; the planner's is left alone):
    lb-mini-padded pads every rank's microbatches to the minibatch's largest count with empty
    microbatches (at the end: LB-Mini sorts each rank's microbatches by cost, descending);
    fsdp2-unsharded gives a rank without microbatches one empty microbatch, whose backward
    carries that rank's part of the minibatch's one reduce-scatter. An empty microbatch is a
    1-token forward and backward with no loss term (data.pack([]))."""
    if policy != "lb-mini-padded" and comm != "fsdp2-unsharded":
        return plan
    plan = copy.deepcopy(plan)
    if policy == "lb-mini-padded":
        plan["policy"] = policy
    for minibatch in plan["minibatches"]:
        ranks = minibatch["ranks"]
        count = max(len(r["microbatches"]) for r in ranks) if policy == "lb-mini-padded" else 1
        for rank in ranks:
            rank["microbatches"] += [[] for _ in range(count - len(rank["microbatches"]))]
    return plan


def fsdp_modules(model) -> list:
    """Every fully_shard module of `model`, the root first (model.modules() order: the order in
    which forward reaches them)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class GradientSync:
    """When an arm's FSDP2 model gathers parameters and reduces gradients, set per microbatch
    through FSDP2's public switches. Call `begin()` at the minibatch's start (after every rank's
    common start) and `before_microbatch(last)` before each of this rank's microbatches;
    collective and odc leave FSDP2 as it is (odc.torch drives FSDP2 under odc).

    After a minibatch the switches are back at FSDP2's defaults (sync on, reshard after backward
    on), so a microbatch outside a minibatch (the cost fit) runs as plain FSDP2 does."""

    def __init__(self, model, comm: str):
        self.model, self.comm = model, comm

    def begin(self) -> None:
        """fsdp2-unsharded: every FSDP2 unit all-gathers now, asynchronously, in forward order, on
        every rank; the first forward waits for each in its pre-forward hook. Without it each
        unit would all-gather inside the first forward, coupling the ranks layer by layer through
        their first microbatches (which differ in size under LB-Mini)."""
        if self.comm != "fsdp2-unsharded":
            return
        from ..torch import _fsdp2_internals as internals

        internals.lazy_init(self.model)  # the root's streams, before its first forward
        for module in fsdp_modules(self.model):
            module.unshard(async_op=True)

    @contextlib.contextmanager
    def forward_only(self, model):
        """Around a forward-only minibatch of `model` (GRPO's log-probability passes, under
        no_grad). fsdp2-unsharded: every unit all-gathers once on entry (every rank, forward
        order) and stays gathered through this rank's forwards, however many (no collective in
        between, so counts may differ); every unit reshards on exit, freeing the full model
        before the next one gathers. Without backward nothing reshards it otherwise: FSDP2
        reshards a reshard_after_forward=False unit in post-backward only. Other arms: as is
        (collective and fsdp2-deferred all-gather per layer per forward; odc pulls), except that
        collective and fsdp2-deferred reshard the root on exit: FSDP2 never reshards a root after
        forward, and without a backward it would hold the frozen reference's gathered root for
        the whole run (0.47 GB at 1.5b), which the arms' peak memory must not carry."""
        if self.comm == "odc":
            yield
            return
        if self.comm != "fsdp2-unsharded":
            try:
                yield
            finally:
                model.reshard()  # the root's group only; the layers resharded after forward
            return
        from ..torch import _fsdp2_internals as internals

        internals.lazy_init(model)
        modules = fsdp_modules(model)
        handles = [module.unshard(async_op=True) for module in modules]
        for handle in handles:  # the copy-out of each all-gather, before any reshard can run
            handle.wait()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()

    def before_microbatch(self, last: bool) -> None:
        """fsdp2-deferred and fsdp2-unsharded reduce-scatter in the last microbatch's backward
        only; fsdp2-unsharded also keeps parameters unsharded until that backward, which
        reshards them (the optimizer then updates the shards, and the next begin() gathers)."""
        if self.comm not in ("fsdp2-deferred", "fsdp2-unsharded"):
            return
        self.model.set_requires_gradient_sync(last)
        if self.comm == "fsdp2-unsharded":
            self.model.set_reshard_after_backward(last)


class CollectiveCounter:
    """Counts the all-gathers and reduce-scatters FSDP2 issues (one per FSDP2 unit each time),
    through its public custom-collective hooks with FSDP2's own default calls inside, so a run
    can show what an arm did. `take()` returns the counts since the last take."""

    def __init__(self, model):
        import torch.distributed as dist

        from ..torch import _fsdp2_internals as internals

        counts = self.counts = {"all_gather": 0, "reduce_scatter": 0}

        class AllGather(internals.AllGather):  # as FSDP2's DefaultAllGather, counted
            def allocate(self, size, *, dtype, device):
                import torch

                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                counts["all_gather"] += 1
                return dist.all_gather_into_tensor(
                    output_tensor, input_tensor, group=group, async_op=async_op
                )

        class ReduceScatter(internals.ReduceScatter):  # as FSDP2's DefaultReduceScatter, counted
            def allocate(self, size, *, dtype, device):
                import torch

                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                counts["reduce_scatter"] += 1
                return dist.reduce_scatter_tensor(
                    output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
                )

        for module in fsdp_modules(model):
            module.set_custom_all_gather(AllGather())
            module.set_custom_reduce_scatter(ReduceScatter())

    def take(self) -> dict:
        taken = dict(self.counts)
        for key in self.counts:
            self.counts[key] = 0
        return taken
