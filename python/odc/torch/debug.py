"""Process-group collectives issued inside an ODC minibatch: found by default, named on request.

Under ODC, ranks run different numbers of microbatches, so a collective that user code issues
between minibatch_begin() and minibatch_end() (a loss or metrics all-reduce, clipping before the
end) is reached a different number of times on different ranks and waits forever; with equal
counts it passes, until the day they differ. So, by default, minibatch_end() raises
CollectiveInMinibatchError when any process group of this process ran a collective since
minibatch_begin(), naming the groups and how many ran, on every rank that issued one (the rank
with fewer microbatches raises too, and its abort ends the peers' waits). ODC_DEBUG_COLLECTIVES
(environment, read when OdcFSDP is constructed):
- unset: that check (`check`): it reads every process group's collective sequence number
  (c10d keeps one per group for its desync debugging) at minibatch_begin and minibatch_end: two
  reads per group per minibatch, about a microsecond (docs/torch.md, "Migrating from FSDP2");
- 1 / raise: raise at the first such call, naming the op (e.g. c10d.allreduce_);
- warn: warn once per op and record every call in OdcFSDP.collectives_seen;
- 0 / off: no check.
Safe patterns are in docs/torch.md ("Collectives and minibatches").

How raise/warn work: a TorchDispatchMode, active from minibatch_begin to minibatch_end in the
thread that called minibatch_begin, sees every c10d op (torch.distributed's collectives dispatch
to c10d::*) and every functional collective (_c10d_functional::*, which DTensor uses, e.g. in
clip_grad_norm_). ODC's own transfers never go through torch.distributed, so they are never
reported. Cost: a Python call per dispatched op while active; a debugging aid.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional, Tuple

from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import InvalidArgument

ENV = "ODC_DEBUG_COLLECTIVES"
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
# Not communication: waiting on a functional collective's result, autograd plumbing.
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveInMinibatchError(RuntimeError):
    """A torch.distributed collective ran inside an ODC minibatch (ODC_DEBUG_COLLECTIVES)."""


# What a timed-out minibatch_end adds to its message: the usual cause in a migrated trainer.
TIMEOUT_HINT = (
    "A common cause: a torch.distributed collective inside the minibatch (a metrics "
    "all-reduce, clipping, a barrier) that a rank with fewer microbatches never reaches. "
    f"Collectives inside minibatches raise at minibatch_end unless {ENV}=0; {ENV}=1 names the "
    "first one as it is issued (docs/torch.md, Collectives and minibatches)"
)


def mode_from_environment() -> Optional[str]:
    """None (off), "check" (the default), "raise" or "warn", from $ODC_DEBUG_COLLECTIVES."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "check"):
        return "check"
    if value in ("0", "off", "false", "no"):
        return None
    if value in ("1", "raise", "on", "true", "yes"):
        return "raise"
    if value == "warn":
        return "warn"
    raise InvalidArgument(
        f"{ENV}={value!r}: expected 0 (off), check (the default), 1 (raise) or warn"
    )


def _sequence_numbers() -> Dict[int, Tuple[object, int]]:
    """Every process group of this process: id -> (group, collectives issued on it so far).
    Groups whose backend keeps no sequence number are left out."""
    from torch.distributed import distributed_c10d as c10d

    numbers = {}
    for group in list(c10d._world.pg_map):
        try:
            numbers[id(group)] = (group, int(group._get_sequence_number_for_group()))
        except (RuntimeError, AttributeError, NotImplementedError):
            continue
    return numbers


def _group_name(group) -> str:
    from torch.distributed import distributed_c10d as c10d

    name = c10d._world.pg_names.get(group, "?")
    if group is c10d.GroupMember.WORLD:
        return f"the default group ({name})"
    return f"group {name} (ranks {sorted(c10d.get_process_group_ranks(group))})"


class _Recorder(TorchDispatchMode):
    def __init__(self, guard: "CollectiveGuard"):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # let DTensor desugar into the ops we look for
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in _NAMESPACES and name not in _NOT_COLLECTIVES:
            self.guard.report(f"{func.namespace}.{name}")
        return func(*args, **(kwargs or {}))


class CollectiveGuard:
    """Watches one minibatch at a time: start() at minibatch_begin, stop() then check() at its
    end."""

    def __init__(self, mode: Optional[str]):
        self.mode = mode
        self.seen: List[str] = []
        self._recorder: Optional[_Recorder] = None
        self._warned = set()
        self._numbers: Optional[Dict[int, Tuple[object, int]]] = None
        self._allowed: Dict[int, object] = {}  # groups the check leaves out (allow())

    def allow(self, group) -> None:
        """Leaves `group` out of the check (its collectives are matched by design)."""
        self._allowed[id(group)] = group

    def start(self) -> None:
        if self.mode == "check":
            self._numbers = _sequence_numbers()
            return
        if self.mode is None or self._recorder is not None:
            return
        self._recorder = _Recorder(self)
        self._recorder.__enter__()

    def check(self) -> None:
        """After stop(), check mode: raises CollectiveInMinibatchError when a process group ran
        collectives since start()."""
        before, self._numbers = self._numbers, None
        if before is None:
            return
        ran = []
        for key, (group, number) in _sequence_numbers().items():
            # A group created inside the minibatch counts from zero.
            start = before[key][1] if key in before else 0
            if number > start and key not in self._allowed:
                ran.append(f"{number - start} on {_group_name(group)}")
        if ran:
            raise CollectiveInMinibatchError(
                f"odc.torch: torch.distributed collectives ran inside this minibatch ("
                f"{'; '.join(ran)}). Ranks may run different numbers of microbatches, so a rank "
                "can wait forever for peers that never issue them: move them before "
                "minibatch_begin (e.g. odc.torch.global_count for token counts) or after "
                f"minibatch_end (clipping, metrics). {ENV}=1 names each as it is issued. "
                "Collectives that another thread issues by design (e.g. an asynchronous "
                "checkpoint): give them a process group of their own and call "
                f"engine.allow_collectives(group); {ENV}=0 turns this check off"
            )

    def stop(self) -> None:
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            recorder.__exit__(None, None, None)

    def report(self, op: str) -> None:
        self.seen.append(op)
        message = (
            f"odc.torch ({ENV}): torch.distributed collective {op} inside an ODC minibatch "
            "(between minibatch_begin and minibatch_end). Ranks may run different numbers of "
            "microbatches, so a rank can wait forever for peers that never issue it: move it "
            "before minibatch_begin (e.g. odc.torch.global_count for token counts) or after "
            "minibatch_end (clipping, metrics)."
        )
        if self.mode == "raise":
            raise CollectiveInMinibatchError(message)
        if op not in self._warned:
            self._warned.add(op)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
