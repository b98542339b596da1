"""ODC behind PyTorch FSDP2: per-layer all-gathers become pulls of shards published once per
minibatch, per-layer reduce-scatters become pushes into the owners' fp32 accumulators, and the
only synchronization left in a minibatch is its end. Ranks may run different numbers of
microbatches.

How it plugs in (public FSDP2 extension points; private reads isolated in _fsdp2_internals.py):
- set_custom_all_gather: OdcAllGather fills FSDP2's all-gather output from the published
  symmetric buffers (FSDP2's own copy-in of this rank's slot is rewritten with the same bytes);
  FSDP2's sharded parameters themselves live in those buffers (_fsdp2_internals R7), float32
  shards pulled as float32 and cast to the bfloat16 output in place;
- set_custom_reduce_scatter: OdcReduceScatter pushes FSDP2's reduce-scatter input and hands FSDP2
  a zeroed output, which FSDP2 adds into a .grad preset to a view of one shared zero buffer, so
  no per-microbatch gradient is ever kept (the sums live in the ODC accumulators);
- set_gradient_divide_factor(1.0) + set_force_sum_reduction_for_comms(True): plain sums; the loss
  is scaled by the minibatch's global token count instead (scale_loss);
- at minibatch end every sharded parameter's .grad becomes a DTensor view of its accumulator.
Invariant: nothing in forward or backward calls the process group.

Where: this file holds the engine (OdcFSDP: construction, minibatch begin and end, failure and
reset) and the public functions; _group.py one parameter group's state and hooks; _collectives.py
the two custom collectives; _fsdp2_internals.py every read of FSDP2's private state.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

try:  # FSDP2's public home since torch 2.6; older torch: OdcFSDP refuses, the rest works
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - depends on the torch version
    FSDPModule = None

from .. import nvshmem_heap
from ..comm import Comm
from ..errors import TIMEOUT as _TIMEOUT
from ..errors import Error, InvalidArgument, InvalidUsage
from . import _fsdp2_internals as internals
from . import heap, hybrid, stealing
from ._collectives import OdcAllGather, OdcReduceScatter
from ._group import EngineState, GroupState, buffer_name, comm_view
from .process_group import remake_comm
from ._sums_pending import GradientsNotReadyError
from .debug import TIMEOUT_HINT, CollectiveGuard, CollectiveInMinibatchError, mode_from_environment

# The model's engine (a weak reference): one OdcFSDP per model.
_ENGINE_ATTRIBUTE = "_odc_torch_engine"
# Engines of this process inside a minibatch: scale_loss scales for theirs.
_engines_in_minibatch: "weakref.WeakSet[OdcFSDP]" = weakref.WeakSet()


def _divide_factor(layouts) -> float:
    """What FSDP2 would divide these groups' summed gradients by (R11): the factor the user set
    with set_gradient_divide_factor, else the data-parallel size (every rank of the mesh,
    replicas included, as FSDP2's default mean over ranks)."""
    factors = {internals.gradient_divide_factor(module) for module, _ in layouts}
    if len(factors) > 1:
        raise NotImplementedError(
            "odc.torch: the fully_shard modules divide gradients by different factors "
            f"({sorted(factors, key=str)}): set one with set_gradient_divide_factor on every module"
        )
    factor = factors.pop() if factors else None
    if factor is None:
        mesh = layouts[0][1].slots[0].param.device_mesh if layouts else None
        return float(mesh.size()) if mesh is not None else 1.0
    if not factor > 0:
        raise InvalidArgument(f"odc.torch: gradient divide factor must be positive, got {factor}")
    return float(factor)


class OdcFSDP:
    """ODC for a model already wrapped with fully_shard (per-layer units and the root).

        odc_model = odc.torch.OdcFSDP(model, comm, optimizer)
        for minibatch in minibatches:
            with odc_model.minibatch():          # begin: publish shards; end: .grad = sums
                for microbatch in my_microbatches[minibatch]:   # any count, per rank
                    loss_sum, tokens = ...
                    odc.torch.scale_loss(loss_sum, global_tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # optional
            optimizer.step()

    `comm` must span the same ranks as the FSDP2 mesh: a host odc.Comm for CPU models (gloo), a
    device one (device=<this rank's GPU>) for CUDA models. Collective: every rank constructs it.
    On a 2-D HSDP mesh (replicate, shard) it spans the shard dimension only (one node:
    odc.torch.node_comm(mesh, key)), and minibatch_end sums the nodes' gradients (hybrid.py).
    Given `optimizer`, every optimizer.step() first checks that the last minibatch completed on
    every rank (check_minibatch(): raises instead of stepping on partial sums after a device-side
    timeout); without it, call check_minibatch() before stepping.

    Gradients are FSDP2's: after minibatch_end a parameter has a .grad when it required
    gradients at minibatch_begin and some rank's backward reached it in the minibatch; frozen
    parameters (requires_grad=False, e.g. a frozen tower or the base weights under LoRA-style
    adapters) and parameters no microbatch used have none, so an optimizer leaves them alone.
    Change requires_grad between minibatches only. Forwards run inside minibatches only (outside
    one a peer's optimizer step may be rewriting the shards being read); an exception inside
    `with minibatch()` fails the communicator at once, so peers raise naming this rank and the
    exception, and reset(comm) with a new communicator makes the engine usable again.
    """

    def __init__(
        self, model: nn.Module, comm: Comm, optimizer: Optional[torch.optim.Optimizer] = None
    ):
        internals.check_fsdp2_support(FSDPModule)
        if not isinstance(model, FSDPModule):
            raise _NotFullyShardError(
                "model: odc.torch needs the root module wrapped with fully_shard (and its layers: "
                f"fully_shard(layer) for each, then fully_shard(model)); got {type(model).__name__}"
            )
        _check_comm(comm)
        for module in model.modules():
            existing = getattr(module, _ENGINE_ATTRIBUTE, None)
            if existing is not None and existing() is not None:
                where = "this model" if module is model else "a module of this model"
                raise InvalidUsage(
                    f"odc.torch: {where} already has an OdcFSDP engine: FSDP2's communication "
                    "hooks and odc's buffers belong to that one (a second would replace its "
                    "hooks and gather other buffers). Keep using it (it stays attached to the "
                    "model for the model's lifetime); engine.reset(comm) moves it to a new "
                    "communicator"
                )
        self.model = model
        self.comm = comm
        self.state = EngineState.READY
        self._optimizer = optimizer
        self._end_event = None  # GPU: recorded after the last minibatch_end (check_minibatch)
        self._collective_guard = CollectiveGuard(mode_from_environment())  # ODC_DEBUG_COLLECTIVES
        internals.lazy_init(model)
        self._modules: List[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._groups: List[GroupState] = []
        layouts = [(m, internals.group_layout(m)) for m in self._modules]
        layouts = [(m, layout) for m, layout in layouts if layout is not None]
        for module, layout in layouts:
            self._check_placement(layout)
        if comm.over_nvshmem:
            # NVSHMEM reserved its heap when comm was made and cannot grow it: a model that needs
            # more fails here, on every rank alike (same model, same heap), naming the size and
            # the knob, instead of at some allocation later.
            num_nodes = len(set(comm.topology))
            need = heap.layouts_need(
                [layout for _, layout in layouts],
                comm.world_size,
                comm.world_size // num_nodes,
                deterministic=comm.deterministic,
            )
            nvshmem_heap.check_reserved(need)
        # HSDP (2-D mesh): the cross-replica sum at minibatch end; None on a 1-D mesh.
        self._replicas = hybrid.replica_reduction([layout for _, layout in layouts], comm)
        self.gradient_divide_factor = _divide_factor(layouts)
        self._hsdp_zero_outputs = {}  # (dtype, device) -> zeros; see OdcReduceScatter.allocate
        # While offloaded with views of the closed communicator's buffers still alive (its
        # memory not released yet): memory_bytes() as it was at offload(); else None.
        self._offloaded_memory: Optional[dict] = None
        module_names = {id(module): name for name, module in model.named_modules()}
        for module, layout in layouts:  # the same order on every rank: alloc is collective
            param = layout.slots[0].param
            name = buffer_name(module_names.get(id(module), ""))
            group = GroupState(self, layout, param.device, name)
            group.check_group(internals.shard_process_group(module))
            module.set_custom_all_gather(OdcAllGather(group))
            pushes = OdcReduceScatter(group)
            module.set_custom_reduce_scatter(pushes)
            # Inside a minibatch on a 1-D mesh: push without FSDP2's per-parameter bookkeeping
            # of the zeros it would add (_fsdp2_internals R12); elsewhere FSDP2's own reduce.
            group.marks_in_post_backward = internals.install_reduce_without_bookkeeping(
                module, self._pushes_directly, pushes.push, group.mark_reduced
            )
            self._groups.append(group)
        # Which parameters some rank pushed a gradient for in a minibatch: one float per
        # parameter of every group (slot), summed like the gradients (see minibatch_end).
        self._slot_base = []
        total = 0
        for group in self._groups:
            self._slot_base.append(total)
            total += len(group.layout.slots)
        self._num_slots = total
        self._bind_reduced_flags()
        sum_gradients(model)  # plain sums reach the accumulators; minibatch_end divides them
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)
        for module in self._modules:  # every FSDP2 unit, so an engine on a part is refused too
            setattr(module, _ENGINE_ATTRIBUTE, weakref.ref(self))

    def _bind_reduced_flags(self) -> None:
        per_rank = -(-self._num_slots // self.comm.world_size)
        self._reduced_flags = self.comm.alloc(
            per_rank, accumulator=True, name="odc.torch/<parameters reduced in the minibatch>"
        )

    def _check_placement(self, layout: internals.GroupLayout) -> None:
        param = layout.slots[0].param
        hybrid.is_hybrid(param)  # 1-D or HSDP (replicate, shard); raises for the rest
        on_gpu = param.device.type == "cuda"
        if on_gpu != (self.comm.device is not None):
            raise InvalidArgument(
                f"parameters are on {param.device} but the odc communicator is "
                f"{'on CUDA device ' + str(self.comm.device) if self.comm.device is not None else 'a host one'}: "
                "use odc.Comm(..., device=<GPU index>) for CUDA models and a host Comm for CPU"
            )
        if on_gpu and param.device.index != self.comm.device:
            raise InvalidArgument(
                f"parameters are on {param.device}, the odc communicator on cuda:{self.comm.device}"
            )

    @property
    def in_minibatch(self) -> bool:
        return self.state is EngineState.IN_MINIBATCH

    def _pushes_directly(self) -> bool:
        """Whether a group's post_backward pushes without FSDP2's reduce (R12): inside a
        minibatch on a 1-D mesh (HSDP keeps FSDP2's partial outputs, hybrid.py)."""
        return self.state is EngineState.IN_MINIBATCH and self._replicas is None

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self.state is EngineState.IN_MINIBATCH:
            raise InvalidUsage(
                "odc.torch: optimizer.step() called before minibatch_end(): the gradients are "
                "not summed yet. Step after the `with engine.minibatch():` block"
            )
        self.check_minibatch()

    def check_minibatch(self) -> None:
        """Raises odc.Error unless the last minibatch completed on every rank, so that no partial
        sum reaches an optimizer step. On GPUs minibatch_end() returns before its device barrier
        has run, and a barrier that times out lets the stream go on: this waits (host) for the
        minibatch's end on the GPU, then reads the communicator's device error flag (no
        communication). Called before every optimizer.step() when OdcFSDP was given the
        optimizer; call it yourself before stepping otherwise."""
        if self.state is EngineState.OFFLOADED:
            return  # offload() checked the last minibatch before closing the communicator
        if self._end_event is not None:
            self._end_event.synchronize()
        try:
            self.comm.poll_error()
        except Error as error:
            self._failed()
            raise Error(
                f"odc.torch: the last minibatch did not complete on every rank, so its gradient "
                f"sums are partial; no optimizer step may use them: {error}",
                error.code,
            ) from error
        if self.state is EngineState.FAILED:
            raise InvalidUsage(
                "odc.torch: the engine failed in its last minibatch (its gradient sums are "
                "partial); call reset(<new communicator>) on every rank first"
            )
        self._end_event = None

    def _failed(self) -> None:
        """The communicator failed: no sum of this minibatch may be used, no .grad views it,
        and FSDP2 forgets a backward the failure cut short (R9), so that nothing of the failed
        minibatch reaches the next one after reset()."""
        self.state = EngineState.FAILED
        self._collective_guard.stop()
        _engines_in_minibatch.discard(self)
        for group in self._groups:
            group.drop_grads()
            group.marked.clear()
        internals.recover_after_failed_backward(self.model)
        if self.comm.device is not None:
            # The failed minibatch's kernels (on FSDP2's streams too) finish before its memory
            # is let go; a device wait among them ends at the latest at the timeout.
            torch.cuda.synchronize(self.comm.device)
        for module in self._modules:
            module.reshard()

    def abort(self, reason: str) -> None:
        """Local: fails the engine and its communicator for `reason` (what `with minibatch()`
        does when its body raises; call it yourself around minibatch_begin()/minibatch_end()
        written out by hand). Peers waiting in minibatch_end raise odc.Error naming this rank
        and the reason at once (host communicators and the CUDA transport; over NVSHMEM their
        device waits end at the timeout, naming this rank). reset(comm) recovers."""
        self.comm.abort(reason)
        self._failed()

    def reset(self, comm: Comm) -> None:
        """Collective (every rank, e.g. after a failed minibatch): moves the engine onto `comm`,
        a new communicator over the same ranks, and makes it usable again. The sharded
        parameters (the optimizer's state too) keep the values of the last completed step; the
        failed minibatch's sums are dropped. Close the old communicator afterwards."""
        if self.state is EngineState.IN_MINIBATCH:
            raise InvalidUsage("reset() inside a minibatch: end or abort it first")
        if self.state is EngineState.OFFLOADED:
            raise InvalidUsage(
                "odc.torch: reset() on an offloaded engine: call reload(<new communicator>) "
                "(every rank) instead"
            )
        self._check_new_comm(comm, "reset")
        if comm.closed:
            raise InvalidArgument("reset: the new communicator is closed: pass an open one")
        self._collective_guard.stop()
        self.comm = comm
        for group in self._groups:  # the same order on every rank: alloc is collective
            group.check_group(internals.shard_process_group(group.layout.module))
            group.bind()
        self._bind_reduced_flags()
        self._end_event = None
        self.state = EngineState.READY

    def _check_comm_open(self, call: str) -> None:
        """Before a call that uses the communicator: closing it under the engine (rather than
        through offload()) leaves the engine's buffers unusable; say how to go on."""
        if self.comm.closed:
            raise InvalidUsage(
                f"odc.torch: {call} on an engine whose communicator was closed (comm.close()): "
                "call engine.reset(<new communicator>) on every rank to move the engine onto a "
                "new one over the same ranks (e.g. odc.torch.comm_from_process_group()); to "
                "release odc's memory between phases and get it back, use engine.offload() and "
                "engine.reload() instead of closing the communicator"
            )

    def _check_new_comm(self, comm: Comm, call: str) -> None:
        _check_comm(comm)
        if comm.world_size != self.comm.world_size or comm.device != self.comm.device:
            raise InvalidArgument(
                f"{call}: the new communicator (rank {comm.rank} of {comm.world_size}, device "
                f"{comm.device}) must span the same ranks and device as the old one (rank "
                f"{self.comm.rank} of {self.comm.world_size}, device {self.comm.device})"
            )

    @property
    def offloaded(self) -> bool:
        return self.state is EngineState.OFFLOADED

    def offload(self) -> None:
        """Collective (every rank), between minibatches: releases every odc buffer of this
        engine, e.g. around an RL rollout. FSDP2's sharded parameters move out of the published
        buffers into ordinary tensors on their device (as plain FSDP2 holds them), a .grad
        viewing the gradient sums becomes a copy on that device, and the communicator is closed,
        which frees its buffers and the scheme's memory. The model is then a plain FSDP2 model:
        forwards gather with FSDP2's collective all-gather, and moving it to the CPU
        (model.to("cpu"), verl's param offload) moves its shards and gradients as FSDP2's.
        Costs: a device copy of this rank's shards (and of held gradients), which exist beside
        odc's buffers until the close; reload() pays them back plus a new communicator.
        Memory still viewed by a tensor you took from odc (e.g. a `.grad` kept in a variable)
        is released when that tensor goes (memory_bytes() counts it until then). Raises
        odc.InvalidUsage inside a minibatch, when already offloaded, or on a failed engine, and
        odc.Error (without offloading) where the last minibatch did not complete (check_minibatch)."""
        if self.state is EngineState.IN_MINIBATCH:
            raise InvalidUsage(
                "odc.torch: offload() inside a minibatch: call it between minibatches (after "
                "minibatch_end())"
            )
        if self.state is EngineState.OFFLOADED:
            raise InvalidUsage(
                "odc.torch: offload() called twice: the engine is already offloaded (reload() "
                "first)"
            )
        if self.state is EngineState.FAILED:
            raise InvalidUsage(
                "odc.torch: offload() on a failed engine: call reset(<new communicator>) on "
                "every rank first"
            )
        self._check_comm_open("offload()")
        self.check_minibatch()  # partial sums must not leave as gradients
        held = self.memory_bytes()
        for group in self._groups:
            group.offload()
        self._reduced_flags = None
        self._hsdp_zero_outputs.clear()
        if self.comm.device is not None:
            # The copies out of odc's buffers (current stream) finish before they are freed.
            torch.cuda.synchronize(self.comm.device)
        self.comm.close()
        self._offloaded_memory = held if self.comm.release_pending else None
        self._end_event = None
        self.state = EngineState.OFFLOADED

    def reload(self, comm: Optional[Comm] = None) -> None:
        """Collective (every rank), after offload(): the engine's buffers on a new communicator
        `comm` over the same ranks and device; None: one made as comm_from_process_group made
        the offloaded one (the same process group; communicators made otherwise need `comm`).
        The sharded parameters (on their device again: after model.to("cpu"), move the model
        back first) move into the new published buffers with their current values, held
        gradients stay and the next minibatch adds to them, as before offload(): training
        continues as if nothing happened. Raises odc.InvalidUsage unless offloaded. A failure
        while the buffers are allocated leaves the engine failed (reset(comm) recovers)."""
        if self.state is not EngineState.OFFLOADED:
            raise InvalidUsage(
                f"odc.torch: reload() without offload(): the engine is {self.state.value} and "
                "holds its buffers"
            )
        for group in self._groups:
            layout = internals.group_layout(group.layout.module)
            self._check_placement(layout)  # on the CPU still (verl's offload): move back first
        if comm is None:
            comm = remake_comm(self.comm)
            if comm is None:
                raise InvalidArgument(
                    "odc.torch: reload() without a communicator: the offloaded one was not made "
                    "by odc.torch.comm_from_process_group; pass reload(<new communicator over "
                    "the same ranks>)"
                )
        self._check_new_comm(comm, "reload")
        self.comm = comm
        self._offloaded_memory = None
        try:  # collective from here (alloc): a failure on one rank must not strand its peers
            for group in self._groups:  # the same order on every rank: alloc is collective
                layout = internals.group_layout(group.layout.module)  # params may be reassigned
                if layout.shard_numel != group.layout.shard_numel:
                    raise InvalidUsage(
                        f"odc.torch: the parameters of {group.name} changed size while offloaded"
                    )
                group.layout = layout
                group.check_group(internals.shard_process_group(layout.module))
                grads = [slot.param.grad for slot in layout.slots]
                group.bind()  # drops .grad: the held sums are set back below
                for slot, grad in zip(layout.slots, grads):
                    slot.param.grad = grad
                del grads
            self._bind_reduced_flags()
        except BaseException as error:
            self.abort(f"{type(error).__name__} in reload: {error}")
            raise
        self.state = EngineState.READY

    def scale_loss(self, loss_sum: torch.Tensor, global_tokens: int) -> torch.Tensor:
        """odc.torch.scale_loss for this engine's model: the value loss_sum / global_tokens,
        its gradient gradient_divide_factor times that, so that the gradients after
        minibatch_end are those of the minibatch's token-mean loss over all ranks."""
        if global_tokens <= 0:
            raise InvalidArgument(f"global_tokens must be positive, got {global_tokens}")
        return _LossScale.apply(loss_sum, float(global_tokens), self.gradient_divide_factor)

    def allow_collectives(self, group: dist.ProcessGroup) -> None:
        """Collectives on `group` inside minibatches are matched by the caller's own design
        (e.g. the members of a split sample exchanging K/V, who all run its chunks): the default
        check at minibatch_end leaves them out. Every other group stays checked."""
        self._collective_guard.allow(group)

    @property
    def collectives_seen(self) -> List[str]:
        """torch.distributed ops issued inside minibatches (recorded with ODC_DEBUG_COLLECTIVES)."""
        return list(self._collective_guard.seen)

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of odc symmetric memory this model uses per rank (published shards,
        accumulators and what the accumulation scheme adds; allocated by libodc, so torch's memory
        statistics do not include them)."""
        return self.memory_bytes()["total"]

    def memory_bytes(self) -> dict:
        """Per-rank bytes of odc.torch's buffers, by kind: `published` (this rank's shards,
        symmetric memory), of which `published_in_place` are FSDP2's own sharded parameters
        moved there (R7: torch's allocator no longer holds them, so they cost nothing beyond
        plain FSDP2; the rest is a copy in param_dtype), `accumulators` (fp32 gradient sums of
        the trainable parameters, symmetric memory; .grad views them after minibatch_end, where
        plain FSDP2 holds its own sharded gradients; during a minibatch no .grad is kept, R5;
        plus one float per parameter tensor that records which ones got gradients), `scheme`
        (what the communicator's accumulation scheme adds, shared by every engine on it: the
        streamed scheme's staging rings (host transports and NVSHMEM), at most the staging budget;
        pending sums in deterministic mode; 0 with CUDA's remote adds), `node_cache` (with more
        than one node: other nodes' published shards fetched once per node and minibatch, at
        most the node cache's budget, also shared by every engine on the communicator), and
        `total`: every byte of symmetric memory odc holds for this engine on this rank (the kinds
        above, in-place shards included, since they live in odc's memory now; a 1 KB control
        block per communicator aside). A host communicator's total is what this rank maps from
        /dev/shm (tests/python/test_torch_migration.py checks it against /proc/self/maps).
        Offloaded (offload()): 0 for every kind, or, while a tensor taken from odc's buffers
        before offload() still views them, what they held then (released when it goes)."""
        if self.state is EngineState.OFFLOADED:
            if self._offloaded_memory is not None and self.comm.release_pending:
                return dict(self._offloaded_memory)
            kinds = ("published", "accumulators", "scheme", "node_cache")
            return {**dict.fromkeys(kinds, 0), "published_in_place": 0, "total": 0}
        published = in_place = accumulators = 0
        for group in self._groups:
            size = group.layout.shard_numel * (4 if group.published.dtype == "float32" else 2)
            published += size
            in_place += size if group.in_place is not None else 0
            accumulators += group.grad_numel * 4
        accumulators += self._reduced_flags.count * 4
        communicator = self.comm.memory_bytes()
        kinds = {
            "published": published,
            "accumulators": accumulators,
            "scheme": communicator["scheme"],
            "node_cache": communicator["node_cache"],
        }
        return {**kinds, "published_in_place": in_place, "total": sum(kinds.values())}

    def hsdp_zero_output(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """HSDP: a view of the zero buffer every group's reduce-scatter output shares (see
        OdcReduceScatter.allocate), grown to the largest group's shard on first use."""
        key = (dtype, torch.device(device))
        buffer = self._hsdp_zero_outputs.get(key)
        if buffer is None or buffer.numel() < numel:
            largest = max(group.layout.shard_numel for group in self._groups)
            buffer = torch.zeros(max(largest, numel), dtype=dtype, device=device)
            self._hsdp_zero_outputs[key] = buffer
        return buffer[:numel]

    @property
    def replica_reduction(self) -> Optional[hybrid.ReplicaReduction]:
        """HSDP meshes: the cross-replica gradient reduction (its `seconds`, `bytes_per_minibatch`);
        None on a 1-D mesh."""
        return self._replicas

    def minibatch_begin(self) -> None:
        """Collective: publishes this rank's updated shards and opens the minibatch."""
        if self.state is EngineState.IN_MINIBATCH:
            raise InvalidUsage("minibatch_begin() called twice without minibatch_end()")
        if self.state is EngineState.FAILED:
            raise InvalidUsage(
                "odc.torch: the engine's communicator failed in an earlier minibatch; call "
                "reset(<new communicator>) on every rank before the next minibatch"
            )
        if self.state is EngineState.OFFLOADED:
            raise InvalidUsage(
                "odc.torch: minibatch_begin() on an offloaded engine: call reload() on every "
                "rank first"
            )
        self._check_comm_open("minibatch_begin()")
        for module in self._modules:
            module.reshard()  # unsharded parameters may predate the optimizer step
        # The end of every backward then orders the current stream after the pushes.
        self.model.set_is_last_backward(True)
        if self._replicas is not None:
            self._replicas.disable_fsdp_all_reduce(self._modules)
        # Sums still held in .grad (no zero_grad since the last minibatch_end) carry over, as
        # FSDP2 adds into .grad until it is zeroed; the last minibatch_end divided them, and
        # (HSDP) the next one sums every replica's copy of them again.
        replicas = 1 if self._replicas is None else self._replicas.num_replicas
        carry_scale = self.gradient_divide_factor / replicas
        try:  # collective from here: a failure on one rank must not leave its peers waiting
            for group in self._groups:
                layout = internals.group_layout(group.layout.module)  # params may be reassigned
                if layout.shard_numel != group.layout.shard_numel:
                    raise InvalidUsage(
                        f"odc.torch: the parameters of {group.name} changed size after OdcFSDP "
                        "took the model (parameters reassigned since must keep their shapes)"
                    )
                group.layout = layout
                held = group.held_grads()
                trainable = tuple(
                    i for i, slot in enumerate(layout.slots) if slot.param.requires_grad
                )
                if held and trainable != group.trainable:
                    raise InvalidUsage(
                        f"odc.torch: requires_grad changed in {group.name} while .grad still "
                        "holds gradient sums (no zero_grad since the last minibatch): call "
                        "optimizer.zero_grad() before freezing or unfreezing parameters"
                    )
                # Frozen or unfrozen since the last minibatch: resize the sums (collective).
                group.refresh_trainable()
                # FSDP2 must not add into the sums .grad views, nor keep gradients of its own.
                group.begin_sums(held, carry_scale)
                group.publish()
            self.comm.minibatch_begin()  # zeroes the sums not kept; every rank has published
        except BaseException as error:
            self.abort(f"{type(error).__name__} in minibatch_begin: {error}")
            raise
        self.state = EngineState.IN_MINIBATCH
        _engines_in_minibatch.add(self)
        self._collective_guard.start()

    def minibatch_end(self) -> None:
        """Collective: when it returns (host) / in stream order (GPU), every parameter's .grad
        holds the sum over all ranks' microbatches of this minibatch (None for parameters that
        were frozen or that no rank's backward reached). On an HSDP mesh the node's sums are
        then all-reduced across replicas: collective over every rank of the job. A failure
        (a peer failed or aborted, a timeout) leaves the engine failed: see reset()."""
        if self.state is not EngineState.IN_MINIBATCH:
            raise InvalidUsage("minibatch_end() without minibatch_begin()")
        self._collective_guard.stop()
        _engines_in_minibatch.discard(self)
        try:
            self._collective_guard.check()  # collectives inside the minibatch (debug.py)
            for group in self._groups:
                if group.kept:
                    group.check_carried()
        except (CollectiveInMinibatchError, RuntimeError) as error:
            self.abort(str(error))
            raise
        if self.comm.device is not None:
            # The pushes ran on FSDP2's reduce-scatter stream; FSDP2 orders the current stream
            # after it only at the end of a backward it was told is the last
            # (set_is_last_backward): a loop that clears that flag must not end before them.
            internals.order_current_stream_after_reduces(self._modules)
        try:
            everything = self._push_reduced_flags()
            self.comm.minibatch_end()
        except Error as error:
            self._failed()
            if error.code == _TIMEOUT:
                raise Error(f"{error}. {TIMEOUT_HINT}", error.code) from error
            raise
        except BaseException:
            self._failed()
            raise
        if self.comm.device is not None:  # what check_minibatch() waits for before a step
            self._end_event = torch.cuda.Event()
            self._end_event.record(torch.cuda.current_stream(self.comm.device))
        if self._replicas is not None:  # HSDP: the node's sums, summed across replicas
            accumulators = [g.accumulator.tensor() for g in self._groups if g.accumulator]
            self._replicas.reduce(accumulators)
        if self.gradient_divide_factor != 1.0:  # FSDP2's division (R11), after the sums
            for group in self._groups:
                if group.accumulator is not None:
                    group.accumulator.tensor().div_(self.gradient_divide_factor)
        reduced = self._reduced_everywhere(everything)
        for group, base in zip(self._groups, self._slot_base):
            group.set_grads(lambda index, base=base: reduced(base + index))
        # Forwards outside a minibatch must gather (FSDP2's own all-gather then), never reuse
        # parameters a forward left unsharded (FSDP2 keeps the root's after forward), stale
        # after the step.
        for module in self._modules:
            module.reshard()
        self.state = EngineState.READY

    def _push_reduced_flags(self) -> bool:
        """Pushes 1 for every parameter this rank pushed gradients for; returns whether that
        was every trainable parameter (then every rank knows they all have sums)."""
        world = self.comm.world_size
        on_gpu = self.comm.device is not None
        # Pinned, copied without blocking: minibatch_end must not wait on the host for the
        # backward still running on the GPU (the copy is ordered on the current stream).
        flags = torch.zeros(
            world * self._reduced_flags.count, dtype=torch.float32, pin_memory=on_gpu
        )
        everything = True
        for group, base in zip(self._groups, self._slot_base):
            for index in group.pushed:
                flags[base + index] = 1.0
            everything = everything and len(group.pushed) == len(group.grad_offsets)
        if on_gpu:
            flags = flags.to(torch.device("cuda", self.comm.device), non_blocking=True)
        self.comm.scatter_accumulate(comm_view(flags, self.comm), self._reduced_flags)
        return everything

    def _reduced_everywhere(self, everything: bool) -> Callable[[int], bool]:
        """Whether some rank pushed a gradient for a parameter (by its flag index). Reads the
        summed flags only when this rank did not push every trainable parameter itself (a host
        read of a few bytes; on GPUs it waits for the minibatch's end). HSDP: the node's flags
        (complete after minibatch_end's barrier) are all-reduced across replicas, on every rank
        (collective over the replica group), so no rank reads a peer's half-reduced flags."""
        if everything and self._replicas is None:
            return lambda index: True
        world = self.comm.world_size
        device = "cpu" if self.comm.device is None else torch.device("cuda", self.comm.device)
        gathered = torch.zeros(
            world * self._reduced_flags.count, dtype=torch.float32, device=device
        )
        self.comm.gather(comm_view(gathered, self.comm), self._reduced_flags)
        if self._replicas is not None:
            dist.all_reduce(gathered, op=dist.ReduceOp.SUM, group=self._replicas.group)
        if everything:
            return lambda index: True
        values = gathered.cpu().tolist()
        return lambda index: values[index] > 0.0

    def microbatches(
        self,
        plan: Any,
        *,
        costs: Optional[Sequence[Sequence[float]]] = None,
        lengths: Optional[Sequence[int]] = None,
        cost: Sequence[float] = (1.0, 0.0, 0.0),
        steal: bool = True,
    ) -> Iterator["stealing.Claimed"]:
        """Inside a minibatch: the microbatches this rank should compute now, as lists of sample
        indices (each also carries .queue, .index and .stolen: where the plan put it).

            with engine.minibatch():
                for samples in engine.microbatches(plan["minibatches"][step], lengths=lengths):
                    odc.torch.scale_loss(loss_sum(samples), global_tokens).backward()

        `plan`: this minibatch of odc.plan's result, or every rank's microbatches (lists of
        sample indices), the same on every rank (collective: every rank iterates to the end).
        This rank's own microbatches come first; once they are all claimed it takes the last
        unclaimed microbatch of the rank with the most predicted work left (work stealing,
        docs/torch.md): each planned microbatch is computed exactly once, by some rank, and its
        gradients reach their owners whoever computed it. Predicted costs: `costs` (per rank,
        per microbatch), or priced from `lengths` (every sample's tokens) with the planner's
        cost model `cost` = (a, b, c[, floor]), else 1 each. On a GPU a claim of an own
        microbatch waits until this rank's GPU has at most one microbatch queued, and a steal
        until it has none (a rank steals when it is free, as the planner's model assumes).
        steal=False yields this rank's own microbatches only (the plan as planned). Stealing
        changes which rank pushes a microbatch, so the deterministic mode refuses it."""
        return stealing.microbatches(
            self, plan, costs=costs, lengths=lengths, cost=cost, steal=steal
        )

    def steal_stats(self) -> dict:
        """Microbatches this rank took from its own queue and from other ranks' (`own`,
        `stolen`: the current or last minibatch; `own_total`, `stolen_total`: since the
        communicator was made)."""
        return self.comm.work_board_stats()

    @contextlib.contextmanager
    def minibatch(self) -> Iterator["OdcFSDP"]:
        """minibatch_begin() ... minibatch_end(). When the body raises, the minibatch is
        aborted (abort()): the communicator fails at once, so peers raise naming this rank and
        the exception instead of waiting out their timeout, and the exception propagates."""
        self.minibatch_begin()
        try:
            yield self
        except BaseException as error:
            if self.state is EngineState.IN_MINIBATCH:
                self.abort(f"{type(error).__name__} inside a minibatch: {error}")
            raise
        self.minibatch_end()


class _NotFullyShardError(InvalidArgument, TypeError):
    """A model not wrapped with fully_shard: odc.InvalidArgument (so a ValueError), and the
    TypeError this raised before the one error policy (docs/errors.md)."""


def _check_comm(comm: Comm) -> None:
    if comm.world_size < 2:
        raise InvalidArgument(
            "comm: odc.torch needs at least 2 ranks (FSDP2 skips its communication hooks on "
            f"one), got a communicator of {comm.world_size}"
        )


def sum_gradients(model: nn.Module) -> None:
    """Makes every fully_shard module of `model` reduce gradients as plain sums (no division by
    the world size), the convention scale_loss relies on. OdcFSDP applies it; a plain FSDP2 model
    trained with scale_loss needs it too, to compute the same gradients."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM (gloo has none)


def scale_loss(loss_sum: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """A microbatch's loss summed over its tokens, normalized by the tokens of the whole
    minibatch on all ranks: the gradients after minibatch_end then equal the single-process
    gradient of the minibatch's token-mean loss, whatever the microbatch counts per rank.

    The value is loss_sum / global_tokens (sum it over a minibatch's microbatches and ranks to
    log the token-mean loss). When its backward runs inside an OdcFSDP minibatch its gradient is
    also multiplied by the
    engine's gradient divide factor (FSDP2's: the world size, or what set_gradient_divide_factor
    set), which the engine's division at minibatch_end undoes. Elsewhere (plain FSDP2 made to
    sum with sum_gradients, or no engine) it is plain division. With several engines in
    minibatches at once, use engine.scale_loss."""
    if global_tokens <= 0:
        raise InvalidArgument(f"global_tokens must be positive, got {global_tokens}")
    return _LossScale.apply(loss_sum, float(global_tokens), None)


def _minibatch_factor() -> float:
    """The gradient divide factor of the engine inside a minibatch now (1 without one)."""
    factors = {engine.gradient_divide_factor for engine in list(_engines_in_minibatch)}
    if len(factors) > 1:
        raise InvalidArgument(
            "odc.torch.scale_loss: several OdcFSDP engines with different gradient divide "
            f"factors ({sorted(factors)}) are inside minibatches: call engine.scale_loss(...) "
            "on the engine whose model computed the loss"
        )
    return factors.pop() if factors else 1.0


class _LossScale(torch.autograd.Function):
    """loss_sum / tokens as a value (what a user logs: the minibatch's token-mean loss share),
    with a gradient `factor` times that of the value, which the engine's division of the sums
    by the same factor at minibatch_end undoes. `factor` None: the factor of the engine inside a
    minibatch when backward runs (the forward may have run outside one). Backward divides
    first, then multiplies, so a power-of-two factor (the usual world size) changes no bit of
    the gradients, and a factor of 1 gives plain division's."""

    @staticmethod
    def forward(ctx, loss_sum, tokens, factor):
        ctx.tokens, ctx.factor = tokens, factor
        return loss_sum / tokens

    @staticmethod
    def backward(ctx, grad):
        factor = _minibatch_factor() if ctx.factor is None else ctx.factor
        scaled = grad / ctx.tokens
        return (scaled if factor == 1.0 else scaled * factor), None, None


def global_count(count: int, group: Optional[dist.ProcessGroup] = None) -> int:
    """Sum of `count` over all ranks (one all-reduce; call once per minibatch, e.g. for tokens)."""
    device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
    total = torch.tensor([int(count)], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=group)
    return int(total.item())


__all__ = [
    "EngineState",
    "GradientsNotReadyError",
    "OdcFSDP",
    "global_count",
    "scale_loss",
    "sum_gradients",
]
