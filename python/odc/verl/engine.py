"""verl's FSDP2 engine with ODC: each rank runs its own number of microbatches per minibatch.

OdcEngineWithLMHead subclasses verl 0.9.1's FSDPEngineWithLMHead (as verl's own fsdp_turbo backend
does) and changes only training: the model is built and sharded by verl's FSDP2 path, then
odc.torch.OdcFSDP takes over its collectives once the optimizer exists. Invariant: between
minibatch_begin() and minibatch_end() no torch.distributed collective runs on this rank (a rank
with fewer microbatches would never reach it); verl's own collectives (the token count, the
metrics, clipping) run before or after the minibatch. Forward-only passes (log-probs) are verl's
own, equal counts, outside any minibatch: FSDP2's collective gathers, as under verl's engine.

What of verl this relies on beyond its public engine interface (checked against verl 0.9.1; a
change in any of them is a change here; register() warns on another verl version):
  V1 FSDPEngine._build_fsdp_module builds FSDP2 only when engine_config.strategy == "fsdp2".
  V2 FSDPEngine._build_model_optimizer sets self.module and self.optimizer (None when
     forward-only); the optimizer is built over the FSDP2 module's parameters.
  V3 FSDPEngine.forward_backward_batch: copied below with two changes (same_micro_num_in_dp=False;
     the loop inside one odc minibatch); train_batch calls optimizer_zero_grad before it and
     optimizer_step after it.
  V4 verl.workers.engine.utils.prepare_micro_batches / postprocess_batch_func: no collective
     when same_micro_num_in_dp=False; metrics come back as one Metric per key.
  V5 Metric.aggregate_dp: SUM/MEAN average over ranks per microbatch position, MIN/MAX over all.
tests/python/test_verl_backend.py exercises V1-V5 against the stock engine.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

import odc.torch
from odc.errors import InvalidUsage


def unsupported_setting(engine_config, model_config) -> Optional[str]:
    """The first setting the odc backend does not support, as 'name=value', or None. A
    forward-only engine (the reference model under strategy=odc) is plain FSDP2: all allowed."""
    if getattr(engine_config, "forward_only", False):
        return None
    if getattr(engine_config, "ulysses_sequence_parallel_size", 1) > 1:
        return f"ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size}"
    if getattr(model_config, "lora_rank", 0) > 0:
        return f"lora_rank={model_config.lora_rank} (LoRA)"
    for name in ("param_offload", "optimizer_offload", "offload_policy"):
        if getattr(engine_config, name, False):
            return f"{name}=True"
    fsdp_size = getattr(engine_config, "fsdp_size", -1) or -1
    if 0 < fsdp_size and dist.is_initialized() and fsdp_size < dist.get_world_size():
        return f"fsdp_size={fsdp_size} (HSDP: shard over fewer ranks than the job's)"
    return None


def refuse(setting: str) -> InvalidUsage:
    return InvalidUsage(
        f"odc.verl: {setting} is not supported by the odc backend (docs/verl.md); "
        "use strategy=fsdp2 for this job or turn the setting off"
    )


class OdcEngineWithLMHead(FSDPEngineWithLMHead):
    """Engine `odc` (actor_rollout_ref.actor.strategy=odc, or engine.strategy=odc for SFT)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        setting = unsupported_setting(engine_config, model_config)
        if setting is not None:  # before verl builds meshes or loads anything
            raise refuse(setting)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.odc_engine: Optional[odc.torch.OdcFSDP] = None

    def _build_fsdp_module(self, module):
        # verl's FSDPEngine builds FSDP2 only when the strategy reads "fsdp2" (else FSDP1 or an
        # error); the model odc runs on is exactly that one, so build it under that name.
        strategy = self.engine_config.strategy
        object.__setattr__(self.engine_config, "strategy", "fsdp2")  # its dataclass is frozen
        try:
            return super()._build_fsdp_module(module)
        finally:
            object.__setattr__(self.engine_config, "strategy", strategy)

    def _build_model_optimizer(self):
        super()._build_model_optimizer()
        if self.optimizer is not None:  # a forward-only engine (reference model) stays FSDP2
            self.attach_odc()

    def attach_odc(self) -> None:
        """Collective: OdcFSDP over the data-parallel group, after the optimizer exists (its
        step is then checked against an unfinished minibatch)."""
        comm = odc.torch.comm_from_process_group(self.get_data_parallel_group(), model=self.module)
        self.odc_engine = odc.torch.OdcFSDP(self.module, comm, self.optimizer)

    @contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        # odc pushes every microbatch's gradients to their owners as its backward runs; FSDP2's
        # deferred sync (set_requires_gradient_sync(False)) would keep unsharded gradients instead.
        yield

    def forward_backward_batch(self, data, loss_function: Callable, forward_only=False):
        if forward_only or self.odc_engine is None:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        # verl 0.9.1's FSDPEngine.forward_backward_batch, with each rank's own microbatch count
        # (same_micro_num_in_dp=False) and the microbatches inside one odc minibatch.
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        return_model_output = tu.get_non_tensor_data(data, key="return_model_output", default=False)
        device = next(self.module.parameters()).device
        group = self.get_data_parallel_group()
        # Before the minibatch: the loss divides by the whole minibatch's token count.
        batch_num_tokens = data["loss_mask"].sum().to(device)
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=group, same_micro_num_in_dp=False
        )
        scaler = getattr(self, "scaler", None)
        output_lst = []
        with self.odc_engine.minibatch():
            for index, micro_batch in enumerate(micro_batches):
                with torch.profiler.record_function(f"micro_batch{index}"):
                    loss, meta_info = self.forward_step(
                        micro_batch, loss_function=loss_function, forward_only=False
                    )
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    if not return_model_output:
                        meta_info.pop("model_output", None)
                output_lst.append(meta_info)
        outputs = postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)
        one_value_per_rank(outputs["metrics"], len(micro_batches), group, device)
        return outputs

    def optimizer_step(self):
        # After minibatch_end (forward_backward_batch returned): the .grad are the summed shards,
        # so verl's clipping (one all-reduce) and step run unchanged.
        return super().optimizer_step()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        if device == "cpu" and (model or optimizer) and self.odc_engine is not None:
            # The shards live in odc's published buffers; moving them is not built yet.
            what = " and ".join(n for n, on in (("model", model), ("optimizer", optimizer)) if on)
            raise refuse(f"offloading the {what} to the CPU (engine.to('cpu'))")
        return super().to(device, model=model, optimizer=optimizer, grad=grad)


def one_value_per_rank(metrics: dict, num_micro_batches: int, group, device) -> None:
    """Replaces each Metric's per-microbatch values with one value, in place, so that verl's
    Metric.aggregate_dp (which needs equal counts on every rank) gives what it gives for equal
    counts: SUM: the rank's sum (aggregate_dp's mean over ranks of per-rank sums is the sum of
    per-microbatch means); MEAN: sum * ranks / all ranks' microbatches (the mean over every
    microbatch of the minibatch); MIN/MAX: the rank's min/max. Collective (one all-reduce of the
    microbatch count), after the minibatch. Plain lists stay: verl concatenates them."""
    total = torch.tensor([num_micro_batches], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    num_ranks = dist.get_world_size(group)
    for key, metric in metrics.items():
        if not isinstance(metric, Metric) or not metric.values:
            continue
        values = [float(v) for v in metric.values]
        if metric.aggregation is AggregationType.SUM:
            value = sum(values)
        elif metric.aggregation is AggregationType.MEAN:
            value = sum(values) * num_ranks / float(total.item())
        elif metric.aggregation is AggregationType.MIN:
            value = min(values)
        else:
            value = max(values)
        metrics[key] = Metric(aggregation=metric.aggregation, value=value)


class OdcEngineWithValueHead(OdcEngineWithLMHead):
    """Registered so that critic.strategy=odc fails at initialization with one line, instead of
    verl's 'Unknown backend'."""

    def __init__(self, *args, **kwargs):
        raise refuse("the critic (value model, critic.strategy=odc)")
