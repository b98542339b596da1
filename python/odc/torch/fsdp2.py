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
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import weakref
import enum
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

try:  # FSDP2's public home since torch 2.6; older torch: OdcFSDP refuses, the rest works
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - depends on the torch version
    FSDPModule = None

from .. import nvshmem_heap
from ..comm import Comm
from ..errors import INVALID_USAGE as _INVALID_USAGE
from ..errors import TIMEOUT as _TIMEOUT
from ..errors import Error, InvalidArgument, InvalidUsage
from . import _fsdp2_internals as internals
from . import heap, hybrid
from ._errors import MismatchError, UnexplainedStateError
from ._sums_pending import GradientsNotReadyError, pending_like
from .debug import TIMEOUT_HINT, CollectiveGuard, CollectiveInMinibatchError, mode_from_environment

_ODC_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
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


def _comm_view(tensor: torch.Tensor, comm: Comm):
    """What odc.Comm takes for `tensor`: a numpy view on host communicators (bf16 as uint16
    bits), the tensor itself on device communicators."""
    if comm.device is not None:
        return tensor
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


class _Group:
    """ODC state of one FSDP2 parameter group: its published shard and its accumulator.

    The accumulator holds the trainable parameters only (requires_grad at the last
    minibatch_begin), packed in the group's order: frozen parameters cost no gradient memory, as
    under FSDP2. FSDP2 reduces only the parameters that got a gradient (R8); a push of fewer than
    the trainable ones is spread into the trainable layout with zeros for the rest."""

    def __init__(
        self,
        owner: "OdcFSDP",
        layout: internals.GroupLayout,
        device: torch.device,
        name: str,
    ):
        for dtype in (layout.param_dtype, layout.reduce_dtype):
            if dtype not in _ODC_DTYPES:
                raise NotImplementedError(
                    f"odc.torch moves float32 and bfloat16, FSDP2 uses {dtype} here"
                )
        self.owner = owner
        self.layout = layout
        self.name = name
        # FSDP2's own sharded parameters move into the published buffer (R7) where their dtype
        # is the all-gather dtype or float32 cast to bfloat16 after the pull (mixed precision):
        # peers then read the shards the optimizer writes, and no second copy exists. Else the
        # shards are copied into a buffer in param_dtype at every minibatch begin.
        # Named: a rank whose groups come in another order fails here instead of gathering
        # another group's weights (the sizes alone may agree). Published: the shards change only
        # between minibatches (publish() at minibatch_begin, the optimizer step after
        # minibatch_end), so the node cache may fetch them once per node and minibatch.
        self.in_place = internals.in_place_dtype(layout)
        # The trainable slots (indices into layout.slots) the accumulator holds, and where each
        # sits in it; None until refresh_trainable() first ran.
        self.trainable: Optional[Tuple[int, ...]] = None
        self.grad_offsets: Dict[int, int] = {}
        self.grad_numel = 0
        self.accumulator = None
        # Slots whose unsharded parameter got a gradient since this group's last push (R8), and
        # the slots this rank pushed in the current minibatch.
        self.marked: Set[int] = set()
        self.pushed: Set[int] = set()
        self._watched = {}  # id(unsharded param) -> (param, hook handle)
        # During a minibatch every trainable parameter's .grad is a placeholder without storage
        # (_sums_pending: it raises, naming the fix, when clipping or a read uses it, and
        # absorbs FSDP2's add of the zeroed reduce-scatter output). Where FSDP2 finds no .grad
        # (a zero_grad inside the minibatch) it assigns a view of the output and calls the
        # parameter's post-accumulate-grad hooks, where the hook begin_sums registers
        # (_grad_replacer) puts the placeholder back (_fsdp2_internals R5): the output is freed
        # when FSDP2's reduce returns, and no per-microbatch gradient memory exists beyond one
        # group's output while it is reduced.
        self._hooked = {}  # id(param) -> (param, hook handle)
        self._pending = {}  # id(param) -> (param, placeholder .grad)
        # Trainable slots whose sums this minibatch adds to (their .grad was not zeroed since
        # the last minibatch_end, as FSDP2 accumulates into .grad until zero_grad).
        self.kept: Set[int] = set()
        # Kept slots whose .grad was set to None inside the minibatch (a zero_grad there): their
        # carried sums can no longer be taken out (check_carried raises).
        self.zeroed_inside: Set[int] = set()
        self._index_of: Dict[int, int] = {}  # id(sharded param) -> slot index
        # The DTensor wrappers that set_grads assigns to .grad, made once per parameter and
        # reused: DTensor.from_local costs tens of microseconds of host time, a 1.5B model has
        # ~340 parameters, and it runs every minibatch while the GPUs wait at its edges (issue
        # #14). Keyed by the parameter object, so a reassigned parameter gets a new wrapper; the
        # memory they view moves only when the accumulator is reallocated (then it is cleared).
        self._sum_grads = {}
        self.bind()
        layout.module.register_forward_pre_hook(_unsharded_watcher(self))

    def bind(self) -> None:
        """Collective: this group's buffers on the owner's (current) communicator; the shards
        move there (in place) or are copied at the next publish()."""
        comm = self.owner.comm
        published_dtype = self.in_place or self.layout.param_dtype
        self.published = comm.alloc(
            self.layout.shard_numel,
            dtype=_ODC_DTYPES[published_dtype],
            name=f"{self.name}:params",
            published=True,
        )
        self.drop_grads()
        self.accumulator, self.trainable = None, None  # a failed communicator's: not freed
        self.refresh_trainable()
        if self.in_place is not None:
            self.publish()  # moves the shards now: their old storage is freed at once

    def drop_grads(self) -> None:
        for slot in self.layout.slots:
            slot.param.grad = None
        self._sum_grads.clear()

    def refresh_trainable(self) -> None:
        """Collective (every rank, groups in the same order): sizes the accumulator for the
        parameters that require gradients now. Reallocates only when that set changed, which
        every rank must agree on: the buffer's name carries it, so ranks that froze different
        parameters fail naming both sets' buffers instead of adding up different layouts."""
        slots = self.layout.slots
        trainable = tuple(i for i, slot in enumerate(slots) if slot.param.requires_grad)
        if trainable == self.trainable:
            return
        comm = self.owner.comm
        if self.accumulator is not None:
            self.drop_grads()  # no view of the old sums may outlive them
            try:
                self.accumulator.free()
            except Error as error:  # views held elsewhere: peers are in the collective free
                comm.abort(f"odc.torch could not free {self.name}'s gradient sums: {error}")
                raise
            self.accumulator = None
        self.grad_offsets, self.grad_numel = {}, 0
        for index in trainable:
            self.grad_offsets[index] = self.grad_numel
            self.grad_numel += slots[index].padded_numel
        self.trainable = trainable
        if not trainable:
            return  # nothing to sum: a frozen unit costs no gradient memory (FSDP2 never reduces it)
        name = f"{self.name}:grads"
        if len(trainable) != len(slots):
            digest = hashlib.sha1(repr(trainable).encode()).hexdigest()[:12]
            name += f":{len(trainable)}/{len(slots)}:{digest}"
        self.accumulator = comm.alloc(self.grad_numel, accumulator=True, name=name)

    def check_group(self, group: dist.ProcessGroup) -> None:
        comm = self.owner.comm
        if group.size() != comm.world_size or group.rank() != comm.rank:
            raise MismatchError(
                f"the FSDP2 mesh (rank {group.rank()} of {group.size()}) does not match the odc "
                f"communicator (rank {comm.rank} of {comm.world_size})"
            )

    def publish(self) -> None:
        """Owner side, between minibatches: this rank's shards to the buffer peers read. In
        place: the shards already live there (the optimizer wrote them); one FSDP2 replaced (e.g.
        load_state_dict(assign=True)) moves back in. Else a copy in param_dtype."""
        flat = self.published.tensor()
        for index, slot in enumerate(self.layout.slots):
            target = flat[slot.offset : slot.offset + slot.padded_numel]
            if self.in_place is not None:
                internals.alias_sharded_param(self.layout.module, index, target)
            else:
                target.copy_(internals.all_gather_input(self.layout.module, index))

    def watch_unsharded(self) -> None:
        """Hooks each unsharded parameter (R8) so that a gradient it gets marks its slot."""
        for index in range(len(self.layout.slots)):
            param = internals.unsharded_param(self.layout.module, index)
            if param is None or not param.requires_grad:  # frozen: no gradient to watch for
                continue
            watched = self._watched.get(id(param))
            if watched is None or watched[0] is not param:
                handle = param.register_post_accumulate_grad_hook(_slot_marker(self, index))
                self._watched[id(param)] = (param, handle)

    def push_source(self, input_tensor: torch.Tensor) -> torch.Tensor:
        """FSDP2's reduce-scatter input in the accumulator's layout: itself when it holds every
        trainable parameter, else a copy with its parameters spread out and zeros for the
        trainable ones it left out. Raises, naming the parameters, when it cannot be matched."""
        slots = self.layout.slots
        now = tuple(i for i, slot in enumerate(slots) if slot.param.requires_grad)
        if now != self.trainable:
            changed = sorted(set(now) ^ set(self.trainable or ()))
            raise InvalidUsage(
                "odc.torch: requires_grad changed inside a minibatch for "
                f"{self._names(changed)}: change it between minibatches (minibatch_begin sizes "
                "the gradient sums for the parameters that require gradients then)"
            )
        if not self.trainable:
            raise UnexplainedStateError(
                f"odc.torch: FSDP2 reduces gradients of {self.name}, all frozen"
            )
        world = self.owner.comm.world_size
        marked, self.marked = self.marked, set()
        if input_tensor.numel() == world * self.grad_numel:
            self.pushed.update(self.trainable)  # FSDP2 packs a subset: equal size, all of them
            return input_tensor
        subset = sorted(marked)
        expected = world * sum(slots[i].padded_numel for i in subset)
        if not subset or not set(subset) <= set(self.trainable) or input_tensor.numel() != expected:
            raise InvalidUsage(
                f"odc.torch: FSDP2 reduces {input_tensor.numel()} gradient elements for "
                f"{self.name}, which matches neither its trainable parameters ({world} x "
                f"{self.grad_numel}) nor those that got a gradient ({self._names(subset)}): "
                "was the module called other than through forward()?"
            )
        rows = input_tensor.view(world, -1)
        spread = input_tensor.new_zeros((world, self.grad_numel))
        position = 0
        for index in subset:
            numel = slots[index].padded_numel
            start = self.grad_offsets[index]
            spread[:, start : start + numel].copy_(rows[:, position : position + numel])
            position += numel
        self.pushed.update(subset)
        return spread.view(-1)

    def _names(self, indices) -> str:
        names = {id(p): n for n, p in self.layout.module.named_parameters()}
        listed = [names.get(id(self.layout.slots[i].param), f"#{i}") for i in indices]
        return ", ".join(listed) if listed else "none"

    def held_grads(self) -> Set[int]:
        """Trainable slots whose parameter still has a .grad (not zeroed since the last
        minibatch_end): their sums carry over into the next minibatch."""
        return {
            index for index in self.grad_offsets if self.layout.slots[index].param.grad is not None
        }

    def begin_sums(self, kept: Set[int], carry_scale: float) -> None:
        """Minibatch begin, before the communicator's: the accumulator keeps the sums of the
        `kept` slots (scaled by `carry_scale`, which undoes the division at the last
        minibatch_end, see OdcFSDP.minibatch_end) and the rest start from zero; then every
        trainable parameter's .grad becomes the placeholder (the sums views of the last
        minibatch must not be added into by FSDP2 while peers push), with the hook that keeps
        it so."""
        self.marked.clear()
        self.pushed.clear()
        self.kept = set(kept)
        self.zeroed_inside.clear()
        self._index_of = {id(slot.param): i for i, slot in enumerate(self.layout.slots)}
        if self.kept:
            # This rank's own shard, before its minibatch_begin: no peer pushes into it before
            # every rank passed that barrier (ordered on the current stream on GPUs).
            flat = self.accumulator.tensor()
            for index, start in self.grad_offsets.items():
                slot = self.layout.slots[index]
                sums = flat[start : start + slot.padded_numel]
                if index not in self.kept:
                    sums.zero_()
                    continue
                grad = slot.param.grad
                cached = self._sum_grads.get(id(slot.param))
                if cached is None or cached[1] is not grad:
                    # Not the view of these sums (a copy for a non-float32 parameter, or a
                    # .grad the user replaced): what .grad holds is what the next sums add to.
                    sums.zero_()
                    sums[: slot.local_numel].copy_(grad.to_local().reshape(-1))
                if carry_scale != 1.0:
                    sums.mul_(carry_scale)
            del flat, sums
            self.accumulator.keep_sums()
        for slot in self.layout.slots:
            param = slot.param
            param.grad = self.pending_grad(param) if param.requires_grad else None
            hooked = self._hooked.get(id(param))
            if param.requires_grad and (hooked is None or hooked[0] is not param):
                handle = param.register_post_accumulate_grad_hook(_grad_replacer(self))
                self._hooked[id(param)] = (param, handle)

    def grad_replaced(self, param: nn.Parameter) -> None:
        """The hook saw FSDP2 assign a new .grad (it found none: zero_grad inside the minibatch)."""
        index = self._index_of.get(id(param))
        if index in self.kept:
            self.zeroed_inside.add(index)

    def check_carried(self) -> None:
        """Raises when a slot whose sums carried over from the last minibatch had its .grad
        zeroed inside this one: the carried part is inside the sums and cannot be taken out
        (FSDP2 would have started that gradient from zero)."""
        zeroed = set(self.zeroed_inside)
        for index in self.kept:
            param = self.layout.slots[index].param
            cached = self._pending.get(id(param))
            if cached is None or param.grad is not cached[1]:
                zeroed.add(index)
        if zeroed:
            raise InvalidUsage(
                "odc.torch: optimizer.zero_grad() (or .grad = None) inside a minibatch whose "
                f"gradient sums carried over from the last one ({self._names(sorted(zeroed))}: "
                ".grad was not zeroed after the last optimizer.step()); odc adds every rank's "
                "pushes into those sums as they arrive and cannot take the carried part out. "
                "Call optimizer.zero_grad() before `with engine.minibatch():` (or right after "
                "optimizer.step())"
            )

    def pending_grad(self, param: nn.Parameter):
        """The placeholder .grad of `param` during a minibatch (made once per parameter)."""
        cached = self._pending.get(id(param))
        if cached is None or cached[0] is not param:
            cached = (param, pending_like(param))
            self._pending[id(param)] = cached
        return cached[1]

    def set_grads(self, reduced: Callable[[int], bool]) -> None:
        """After minibatch end: .grad = DTensor view of this rank's accumulator slice for every
        trainable parameter some rank pushed a gradient for (`reduced(slot index)`) or whose
        sums carried over from the last minibatch; None for the rest, as FSDP2 leaves them (so
        an optimizer skips them: no weight decay, no momentum step)."""
        flat = None
        for index, slot in enumerate(self.layout.slots):
            param = slot.param
            if index not in self.grad_offsets or not (reduced(index) or index in self.kept):
                param.grad = None
                continue
            cached = self._sum_grads.get(id(param))
            if cached is None or cached[0] is not param:
                if flat is None:
                    flat = self.accumulator.tensor()  # fp32, aliases the symmetric memory
                start = self.grad_offsets[index]
                local = flat[start : start + slot.local_numel].view(param.to_local().shape)
                if param.dtype != torch.float32:  # a copy of this minibatch's sums: not kept
                    param.grad = _sharded_like(param, local.to(param.dtype))
                    continue
                cached = (param, _sharded_like(param, local))
                self._sum_grads[id(param)] = cached
            param.grad = cached[1]


def _unsharded_watcher(group: _Group):
    """A forward pre-hook of the group's module, run after FSDP2's (which made the unsharded
    parameters): hooks any unsharded parameter not hooked yet. Holds the group weakly."""
    reference = weakref.ref(group)

    def watch(module, args) -> None:
        alive = reference()
        if alive is not None:
            alive.watch_unsharded()
            if alive.owner.replica_reduction is not None:  # HSDP: its kept outputs are zeros
                internals.forget_partial_reduce_output(module)

    return watch


def _slot_marker(group: _Group, index: int):
    """The post-accumulate-grad hook of an unsharded parameter: marks its slot as part of the
    group's next reduce (R8). Holds the group weakly."""
    reference = weakref.ref(group)

    def mark(param) -> None:
        alive = reference()
        if alive is not None:
            alive.marked.add(index)

    return mark


def _grad_replacer(group: _Group):
    """The post-accumulate-grad hook of a sharded parameter: runs inside FSDP2's reduce right
    after it set .grad (a view of the zeroed output where there was none, else the placeholder
    it added into) and puts the placeholder back while the engine is inside a minibatch. It
    holds the group weakly: the hook stays on the parameter, the engine may go."""
    reference = weakref.ref(group)

    def replace(param: nn.Parameter) -> None:
        alive = reference()
        if alive is not None and alive.owner.in_minibatch:
            pending = alive.pending_grad(param)
            if param.grad is not pending:
                alive.grad_replaced(param)
            param.grad = pending

    return replace


def _buffer_name(module_name: str) -> str:
    """The tag of a parameter group's buffers: its module's name in the model, as printable ASCII
    of at most 220 characters (long names keep their head and a hash of all of it)."""
    name = "odc.torch/" + (module_name or "<root>")
    name = name.encode("ascii", "backslashreplace").decode("ascii")
    name = "".join(c if " " <= c <= "~" else "?" for c in name)
    if len(name) > 220:
        name = name[:180] + "#" + hashlib.sha1(name.encode()).hexdigest()[:16]
    return name


def _sharded_like(param: nn.Parameter, local: torch.Tensor):
    """A DTensor with `param`'s mesh, placements, shape and stride around `local` (no copy)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


class OdcAllGather(internals.AllGather):
    """FSDP2 custom all-gather: output[r*S:(r+1)*S] = rank r's published shard (a pull)."""

    def __init__(self, group: _Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        owner = self.group.owner
        if owner.state is EngineState.READY:
            # Outside a minibatch (evaluation, generation) a peer may be rewriting its shards
            # (its optimizer step) at any time, so a pull could mix old and new weights: gather
            # as FSDP2 does, with its collective all-gather, which every peer joins after its
            # step, in program order. Collective, as under plain FSDP2; training never gets here.
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        if owner.state is EngineState.FAILED:
            raise InvalidUsage(
                "odc.torch: forward on a failed engine: its communicator failed in an earlier "
                "minibatch; call reset(<new communicator>) on every rank first"
            )
        self.group.check_group(group)
        # Enqueued on the current stream: FSDP2's all-gather stream on GPUs. float32 shards into
        # a bfloat16 output (mixed precision, R7) are narrowed by odc while they are pulled, with
        # no float32 copy of the gathered group.
        owner.comm.gather(_comm_view(output_tensor, owner.comm), self.group.published)
        return None


class OdcReduceScatter(internals.ReduceScatter):
    """FSDP2 custom reduce-scatter: push input[r*S:(r+1)*S] into owner r's accumulator and give
    FSDP2 a zeroed output; the sums exist after minibatch_end."""

    def __init__(self, group: _Group):
        self.group = group
        self._last_input_numel = -1

    def allocate(self, size, *, dtype, device):
        # 1-D meshes: input and output alike are plain tensors, as FSDP2's default allocates; the
        # output lives only until FSDP2's reduce returns (R5: the .grad it becomes is dropped).
        # HSDP meshes: FSDP2 keeps the output of every group across the minibatch's microbatches
        # as its partial sum for the replica all-reduce we switched off (_partial_reduce_output),
        # 4 bytes per parameter element held for nothing: the output (the allocation of one
        # shard, numel == shard_numel; the input holds world_size shards) is instead a view of
        # one zero buffer shared by every group, since all it ever holds or gets added is zeros.
        # FSDP2 allocates the input, then the output (1/world of it); a reduce of fewer than all
        # parameters (R8) has a smaller input, so the output is told apart by that ratio.
        owner = self.group.owner
        numel = math.prod(size)
        is_output = numel * owner.comm.world_size == self._last_input_numel
        if not is_output:
            self._last_input_numel = numel
        if owner.replica_reduction is not None and is_output:
            return owner.hsdp_zero_output(numel, dtype, device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        owner = self.group.owner
        if owner.state is not EngineState.IN_MINIBATCH:
            raise InvalidUsage("odc.torch: backward outside a minibatch: call minibatch_begin()")
        self.group.check_group(group)
        if op != dist.ReduceOp.SUM:
            raise InvalidUsage(
                f"odc.torch pushes sums; FSDP2 asked for {op}: leave FSDP2's reduction settings "
                "(set_force_sum_reduction_for_comms, set_gradient_divide_factor) as OdcFSDP set "
                "them"
            )
        if self.group.kept:
            self.group.check_carried()
        source = self.group.push_source(input_tensor)
        owner.comm.scatter_accumulate(
            _comm_view(source, owner.comm),
            self.group.accumulator,
            src_dtype=_ODC_DTYPES[input_tensor.dtype],
        )
        output_tensor.zero_()  # what FSDP2 adds into the preset .grad: nothing
        return None


class EngineState(enum.Enum):
    """Where an OdcFSDP engine stands."""

    READY = "ready"  # between minibatches
    IN_MINIBATCH = "inside a minibatch"  # after minibatch_begin, before minibatch_end
    # The communicator failed (an exception inside a minibatch here, or a peer's failure): no
    # sum of that minibatch reaches an optimizer step; reset(new communicator) recovers.
    FAILED = "failed"


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
        self._groups: List[_Group] = []
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
        module_names = {id(module): name for name, module in model.named_modules()}
        for module, layout in layouts:  # the same order on every rank: alloc is collective
            param = layout.slots[0].param
            name = _buffer_name(module_names.get(id(module), ""))
            group = _Group(self, layout, param.device, name)
            group.check_group(internals.shard_process_group(module))
            module.set_custom_all_gather(OdcAllGather(group))
            module.set_custom_reduce_scatter(OdcReduceScatter(group))
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
            raise Error(
                "odc.torch: the engine failed in its last minibatch (its gradient sums are "
                "partial); call reset(<new communicator>) on every rank first",
                _INVALID_USAGE,
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
        _check_comm(comm)
        if comm.world_size != self.comm.world_size or comm.device != self.comm.device:
            raise InvalidArgument(
                f"reset: the new communicator (rank {comm.rank} of {comm.world_size}, device "
                f"{comm.device}) must span the same ranks and device as the old one (rank "
                f"{self.comm.rank} of {self.comm.world_size}, device {self.comm.device})"
            )
        self._collective_guard.stop()
        self.comm = comm
        for group in self._groups:  # the same order on every rank: alloc is collective
            group.check_group(internals.shard_process_group(group.layout.module))
            group.bind()
        self._bind_reduced_flags()
        self._end_event = None
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
        /dev/shm (tests/python/test_torch_migration.py checks it against /proc/self/maps)."""
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
            raise Error(
                "odc.torch: the engine's communicator failed in an earlier minibatch; call "
                "reset(<new communicator>) on every rank before the next minibatch",
                _INVALID_USAGE,
            )
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
        self.comm.scatter_accumulate(_comm_view(flags, self.comm), self._reduced_flags)
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
        self.comm.gather(_comm_view(gathered, self.comm), self._reduced_flags)
        if self._replicas is not None:
            dist.all_reduce(gathered, op=dist.ReduceOp.SUM, group=self._replicas.group)
        if everything:
            return lambda index: True
        values = gathered.cpu().tolist()
        return lambda index: values[index] > 0.0

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
