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
  V3 FSDPEngine.forward_backward_batch: copied below with its changes (same_micro_num_in_dp=False
     or LB-Mini's rows and microbatches; the loop inside one odc minibatch); train_batch calls
     optimizer_zero_grad before it and optimizer_step after it.
  V4 verl.workers.engine.utils.prepare_micro_batches / postprocess_batch_func: no collective
     when same_micro_num_in_dp=False; metrics come back as one Metric per key.
  V5 Metric.aggregate_dp: SUM/MEAN average over ranks per microbatch position, MIN/MAX over all.
  V6 verl's training batch: rows are the TensorDict's batch dimension (tensors, nested tensors,
     NonTensorStack); NonTensorData entries are per-minibatch settings, equal on every rank;
     a sample's tokens are input_ids' nested row length (else attention_mask's row sum), as
     rearrange_micro_batches counts them; postprocess_batch_func restores model_output's rows
     from the microbatches' index lists.
  V7 FSDPEngine.to moves the FSDP2 model with model.to() (nn.Module._apply; FSDP2 re-points its
     shards after it) and verl calls to() on every rank alike (BaseEngineCtx, initialize), so
     the offload() / reload() this engine's to() adds are collective as they must be.
tests/python/test_verl_backend.py exercises V1-V7 against the stock engine.

LB-Mini (ODC_VERL_LB_MINI, default on; docs/verl.md): before the minibatch every rank gathers all
ranks' sample lengths, computes the same odc.plan(policy="lb-mini"), and rows move to the rank the
plan gives them; per-row outputs (model_output, when asked for) go back to their rows afterwards.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

import odc.torch
from odc.errors import InvalidUsage
from odc.torch._all_to_all import all_to_all_objects
from odc.planner import plan as odc_plan

LB_MINI_ENV = "ODC_VERL_LB_MINI"


def lb_mini_from_environment() -> bool:
    """ODC_VERL_LB_MINI: unset, empty or 1: LB-Mini on (the default); 0: off."""
    value = os.environ.get(LB_MINI_ENV, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise InvalidUsage(f"{LB_MINI_ENV}={value!r}: expected 1 (LB-Mini on, the default) or 0 (off)")


def unsupported_setting(engine_config, model_config) -> Optional[str]:
    """The first setting the odc backend does not support, as 'name=value', or None. A
    forward-only engine (the reference model under strategy=odc) is plain FSDP2: all allowed."""
    if getattr(engine_config, "forward_only", False):
        return None
    if getattr(engine_config, "ulysses_sequence_parallel_size", 1) > 1:
        return f"ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size}"
    if getattr(model_config, "lora_rank", 0) > 0:
        return f"lora_rank={model_config.lora_rank} (LoRA)"
    # param_offload / optimizer_offload work through to() below; FSDP2's CPUOffloadPolicy keeps
    # the shards on the CPU for good, where odc's buffers cannot hold them.
    if getattr(engine_config, "offload_policy", False):
        return "offload_policy=True"
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
        lb_mini = lb_mini_from_environment()
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.odc_engine: Optional[odc.torch.OdcFSDP] = None
        self.lb_mini = lb_mini
        self.last_route: Optional[LbMiniRoute] = None  # the last minibatch's, None without LB-Mini

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
        route = self._lb_mini_route(data, group) if self.lb_mini else None
        self.last_route = route
        if route is None:
            micro_batches, indices = prepare_micro_batches(
                data=data, dp_group=group, same_micro_num_in_dp=False
            )
        else:  # this rank's rows of the plan, then its microbatches of them
            rows = route.move_rows(data, group)
            micro_batches = [tu.index_select_tensor_dict(rows, m) for m in route.microbatches]
            indices = route.microbatches
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
        outputs = postprocess_batch_func(
            output_lst=output_lst, indices=indices, data=data if route is None else rows
        )
        if route is not None and outputs["model_output"]:
            # In this rank's moved rows' order: back to the rows (and ranks) they came from.
            outputs["model_output"] = route.return_rows(outputs["model_output"], group)
        one_value_per_rank(outputs["metrics"], len(micro_batches), group, device)
        return outputs

    def _lb_mini_route(self, data, group) -> Optional["LbMiniRoute"]:
        """Collective (one all-gather of the sample lengths), before the minibatch: the same
        LB-Mini plan on every rank, or None on every rank where it does not apply: fixed-size
        microbatches (use_dynamic_bsz=False, no token bound to plan with), forced sample groups
        (force_group_size > 1), rows that another rank's could not join (other keys, or dense
        tensors of other widths: verl's trainer splits one batch, so they are equal there), or a
        plan that leaves a rank without samples (its metrics would lack the keys the others
        report)."""
        if not tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
            return None
        if tu.get_non_tensor_data(data, key="force_group_size", default=1) != 1:
            return None
        max_tokens = int(tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=0))
        max_tokens *= tu.get_non_tensor_data(data, key="sp_size", default=1)
        gathered: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (sample_lengths(data), row_layout(data)), group=group)
        if any(layout != gathered[0][1] for _, layout in gathered):
            return None  # rows could not be stacked with another rank's (verl's trainer: equal)
        all_lengths = [lengths for lengths, _ in gathered]
        return LbMiniRoute.from_lengths(all_lengths, dist.get_rank(group), max_tokens)

    def optimizer_step(self):
        # After minibatch_end (forward_backward_batch returned): the .grad are the summed shards,
        # so verl's clipping (one all-reduce) and step run unchanged.
        return super().optimizer_step()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's, with odc's buffers following the model (param_offload around rollout, and
        verl's own calls): to("cpu", model=True) first releases every odc buffer
        (OdcFSDP.offload(): the shards and held gradients become ordinary tensors, which verl
        then moves to the CPU as for plain FSDP2); to(<GPU>, model=True) reloads them after
        verl moved the model back (a new communicator on the data-parallel group). The
        optimizer's state is not in odc's memory: optimizer alone moves as under verl's engine.
        Collective, as verl calls it: on every rank."""
        engine = self.odc_engine
        if engine is not None and model and device == "cpu" and not engine.offloaded:
            engine.offload()
        result = super().to(device, model=model, optimizer=optimizer, grad=grad)
        if engine is not None and model and device != "cpu" and engine.offloaded:
            engine.reload()
        return result


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


def sample_lengths(data: TensorDict) -> List[int]:
    """Tokens of each row, as verl's rearrange_micro_batches counts them for max_token_len."""
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return [int(n) for n in input_ids.offsets().diff().tolist()]
    return [int(n) for n in data["attention_mask"].sum(dim=1).tolist()]


def row_layout(data: TensorDict) -> dict:
    """What must agree across ranks for rows to be stacked: each row key, with a dense tensor's
    shape past the batch dimension and dtype (nested tensors and NonTensorStack: their kind)."""
    layout = {}
    for key, value in data.items():
        if isinstance(value, NonTensorData):
            continue
        if isinstance(value, torch.Tensor):
            shape = "nested" if value.is_nested else tuple(value.shape[1:])
            layout[key] = (shape, str(value.dtype))
        else:
            layout[key] = type(value).__name__
    return layout


@dataclass
class LbMiniRoute:
    """One rank's part of a minibatch's LB-Mini plan (the same plan on every rank).

    Samples are numbered globally, rank 0's rows first, then rank 1's (all_lengths' order). The
    rows this rank computes ("its rows") are in ascending global order, hence grouped by the rank
    they come from, and in each group in that rank's row order: the order of the all-to-all.
    """

    rank: int
    plan: dict  # odc.plan's document
    sends: List[List[int]]  # sends[d]: this rank's local rows that rank d computes, ascending
    receives: List[int]  # receives[s]: how many of its rows come from rank s
    microbatches: List[List[int]]  # positions in its rows, one list per microbatch

    @classmethod
    def from_lengths(
        cls, all_lengths: List[List[int]], rank: int, max_tokens: int
    ) -> Optional["LbMiniRoute"]:
        """None where the plan leaves some rank without samples (on every rank alike)."""
        offsets = [0]
        for lengths in all_lengths:
            offsets.append(offsets[-1] + len(lengths))
        flat = [n for lengths in all_lengths for n in lengths]
        num_ranks = len(all_lengths)
        plan = odc_plan(
            flat, ranks=num_ranks, max_tokens=max_tokens, policy="lb-mini", samples_per_rank=None
        )
        (minibatch,) = plan["minibatches"]  # samples_per_rank=None: all samples are one minibatch
        computed = [sorted(g for m in r["microbatches"] for g in m) for r in minibatch["ranks"]]
        if any(not samples for samples in computed):
            return None
        source = [s for s in range(num_ranks) for _ in all_lengths[s]]
        begin, end = offsets[rank], offsets[rank + 1]
        sends = [[g - begin for g in samples if begin <= g < end] for samples in computed]
        receives = [0] * num_ranks
        for g in computed[rank]:
            receives[source[g]] += 1
        position = {g: i for i, g in enumerate(computed[rank])}
        own = minibatch["ranks"][rank]["microbatches"]
        return cls(rank, plan, sends, receives, [[position[g] for g in m] for m in own])

    def move_rows(self, data: TensorDict, group) -> TensorDict:
        """Collective (all-to-all), before the minibatch: this rank's rows of the plan, with the
        minibatch's settings (NonTensorData entries, equal on every rank) kept from `data`."""
        row_keys = [k for k, v in data.items() if not isinstance(v, NonTensorData)]
        outgoing = [
            _rows(data, row_keys, rows) if rows and d != self.rank else None
            for d, rows in enumerate(self.sends)
        ]
        incoming = all_to_all_objects(outgoing, group, to_cpu=_to_cpu)
        local_device = data["input_ids"].device
        parts = [
            _rows(data, row_keys, self.sends[self.rank]) if s == self.rank else part
            for s, part in enumerate(incoming)
        ]
        parts = [p.to(local_device) for p in parts if p is not None and len(p) > 0]
        rows = tu.concat_tensordict(parts)
        for key, value in data.items():
            if isinstance(value, NonTensorData):
                tu.assign_non_tensor_data(rows, key, value.data)
        return rows

    def return_rows(self, model_output: dict, group) -> dict:
        """Collective (all-to-all), after the minibatch: model_output's rows (nested tensors, in
        this rank's rows' order) back to the ranks and rows they came from."""
        starts = [0]
        for count in self.receives:
            starts.append(starts[-1] + count)
        unbound = {key: value.unbind() for key, value in model_output.items()}
        blocks = [
            {key: list(rows[starts[s] : starts[s + 1]]) for key, rows in unbound.items()}
            if self.receives[s]
            else None
            for s in range(len(self.receives))
        ]
        own = blocks[self.rank]
        outgoing = [None if s == self.rank else b for s, b in enumerate(blocks)]
        incoming = all_to_all_objects(outgoing, group, to_cpu=_to_cpu)
        incoming[self.rank] = own
        num_rows = sum(len(rows) for rows in self.sends)
        restored = {}
        for key, value in model_output.items():
            out: List[Optional[torch.Tensor]] = [None] * num_rows
            for d, rows in enumerate(self.sends):
                for row, tensor in zip(rows, incoming[d][key] if rows else ()):
                    out[row] = tensor.to(value.device)
            restored[key] = torch.nested.as_nested_tensor(out, layout=torch.jagged)
        return restored


def _rows(data: TensorDict, keys: List[str], rows: List[int]) -> TensorDict:
    selected = tu.index_select_tensor_dict(data, rows)
    return TensorDict({k: selected[k] for k in keys}, batch_size=[len(rows)])


def _to_cpu(obj):
    """What all_to_all_objects serializes: tensors and verl's TensorDicts on the CPU."""
    if isinstance(obj, (torch.Tensor, TensorDict)):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


class OdcEngineWithValueHead(OdcEngineWithLMHead):
    """Registered so that critic.strategy=odc fails at initialization with one line, instead of
    verl's 'Unknown backend'."""

    def __init__(self, *args, **kwargs):
        raise refuse("the critic (value model, critic.strategy=odc)")
