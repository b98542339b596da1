"""The ODC state of one FSDP2 parameter group (GroupState: its published shard, its fp32
accumulator, the hooks on its module and parameters) and what the engine and FSDP2's custom
collectives share with it. Invariant: the group knows its engine only through GroupOwner (its
communicator and state), so this module imports nothing of the engine's (fsdp2.py imports it).
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from typing import TYPE_CHECKING, Callable, Dict, Optional, Protocol, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm
from ..errors import Error, InvalidUsage
from . import _fsdp2_internals as internals
from ._errors import MismatchError, UnexplainedStateError
from ._sums_pending import pending_like

if TYPE_CHECKING:
    from .hybrid import ReplicaReduction

# The dtypes odc moves, by torch dtype: odc.Comm's names for them.
ODC_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class EngineState(enum.Enum):
    """Where an OdcFSDP engine stands."""

    READY = "ready"  # between minibatches
    IN_MINIBATCH = "inside a minibatch"  # after minibatch_begin, before minibatch_end
    # The communicator failed (an exception inside a minibatch here, or a peer's failure): no
    # sum of that minibatch reaches an optimizer step; reset(new communicator) recovers.
    FAILED = "failed"
    # offload() released every odc buffer (the communicator is closed): FSDP2's sharded
    # parameters and any held .grad are ordinary tensors, forwards gather as plain FSDP2 does;
    # reload() makes the engine READY again on a new communicator.
    OFFLOADED = "offloaded"


class GroupOwner(Protocol):
    """What a group and its collectives read of the engine that owns it (OdcFSDP): written out so
    that the group needs no import of the engine, which imports the group."""

    comm: Comm  # replaced by reset(); the group reads it at every use
    state: EngineState

    @property
    def in_minibatch(self) -> bool: ...

    @property
    def replica_reduction(self) -> Optional[ReplicaReduction]: ...  # None on a 1-D mesh

    def hsdp_zero_output(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor: ...


def comm_view(tensor: torch.Tensor, comm: Comm):
    """What odc.Comm takes for `tensor`: a numpy view on host communicators (bf16 as uint16
    bits), the tensor itself on device communicators."""
    if comm.device is not None:
        return tensor
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


class GroupState:
    """ODC state of one FSDP2 parameter group: its published shard and its accumulator.

    The accumulator holds the trainable parameters only (requires_grad at the last
    minibatch_begin), packed in the group's order: frozen parameters cost no gradient memory, as
    under FSDP2. FSDP2 reduces only the parameters that got a gradient (R8); a push of fewer than
    the trainable ones is spread into the trainable layout with zeros for the rest."""

    def __init__(
        self,
        owner: GroupOwner,
        layout: internals.GroupLayout,
        device: torch.device,
        name: str,
    ):
        for dtype in (layout.param_dtype, layout.reduce_dtype):
            if dtype not in ODC_DTYPES:
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
        # Whether the group's post_backward marks the slots itself (R12 installed): then no hook
        # per unsharded parameter does (watch_unsharded).
        self.marks_in_post_backward = False
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
            dtype=ODC_DTYPES[published_dtype],
            name=f"{self.name}:params",
            published=True,
        )
        self.drop_grads()
        self.accumulator, self.trainable = None, None  # a failed communicator's: not freed
        self.refresh_trainable()
        if self.in_place is not None:
            self.publish()  # moves the shards now: their old storage is freed at once

    def offload(self) -> None:
        """Between minibatches, before the communicator is closed: FSDP2's sharded parameters
        leave the published buffer for ordinary tensors on their device (as FSDP2 keeps them,
        one per parameter; publish() moves them back), and a .grad viewing the accumulator
        becomes a copy (the sums the next minibatch adds to, as FSDP2's .grad), so that nothing
        of this group views odc memory any more."""
        if self.in_place is not None:
            for index in range(len(self.layout.slots)):
                shard = internals.sharded_storage(self.layout.module, index)
                internals.alias_sharded_param(self.layout.module, index, torch.empty_like(shard))
        if self.accumulator is not None:
            flat = self.accumulator.tensor()
            begin = flat.data_ptr()
            end = begin + flat.numel() * flat.element_size()
            del flat
            for slot in self.layout.slots:
                grad = slot.param.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                if local is not None and begin <= local.data_ptr() < end:
                    slot.param.grad = _sharded_like(slot.param, local.clone())
                del grad, local
        self._sum_grads.clear()
        self.published, self.accumulator = None, None

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
        """Hooks each unsharded parameter (R8) so that a gradient it gets marks its slot, unless
        the group's post_backward marks them (mark_reduced)."""
        if self.marks_in_post_backward:
            return
        for index in range(len(self.layout.slots)):
            param = internals.unsharded_param(self.layout.module, index)
            if param is None or not param.requires_grad:  # frozen: no gradient to watch for
                continue
            watched = self._watched.get(id(param))
            if watched is None or watched[0] is not param:
                handle = param.register_post_accumulate_grad_hook(_slot_marker(self, index))
                self._watched[id(param)] = (param, handle)

    def mark_reduced(self, indices) -> None:
        """The slots the group's next reduce covers (R8), from its post_backward (R12)."""
        self.marked.update(indices)

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


# The hook factories. GroupState looks them up in this module each time it makes a hook, so
# wrapping them here (dev/gpu/host_floor.py --attribute) times every hook an engine installs.


def _unsharded_watcher(group: GroupState):
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


def _slot_marker(group: GroupState, index: int):
    """The post-accumulate-grad hook of an unsharded parameter: marks its slot as part of the
    group's next reduce (R8). Holds the group weakly."""
    reference = weakref.ref(group)

    def mark(param) -> None:
        alive = reference()
        if alive is not None:
            alive.marked.add(index)

    return mark


def _grad_replacer(group: GroupState):
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

    # Not called by the direct push while .grad is set: that push leaves .grad as it is.
    setattr(replace, internals.NOT_AFTER_DIRECT_PUSH, True)
    return replace


def buffer_name(module_name: str) -> str:
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
