"""ODC_DEBUG_COLLECTIVES: find process-group collectives issued inside an ODC minibatch.

Under ODC, ranks run different numbers of microbatches, so a collective that user code issues
between minibatch_begin() and minibatch_end() (a loss or metrics all-reduce, clipping before the
end) is reached a different number of times on different ranks and waits forever. With
ODC_DEBUG_COLLECTIVES=1 (or `raise`) OdcFSDP raises CollectiveInMinibatchError at the first such
call, naming it; with `warn` it warns once per op and records every call in
`OdcFSDP.collectives_seen`. Safe patterns are in docs/torch.md ("Collectives and minibatches").

How: a TorchDispatchMode, active from minibatch_begin to minibatch_end in the thread that called
minibatch_begin, sees every c10d op (torch.distributed's collectives dispatch to c10d::*) and
every functional collective (_c10d_functional::*, which DTensor uses, e.g. in clip_grad_norm_).
ODC's own transfers never go through torch.distributed, so they are never reported. Cost: a
Python call per dispatched op while active; a debugging aid, off by default.
"""

from __future__ import annotations

import os
import warnings
from typing import List, Optional

from torch.utils._python_dispatch import TorchDispatchMode

ENV = "ODC_DEBUG_COLLECTIVES"
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
# Not communication: waiting on a functional collective's result, autograd plumbing.
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveInMinibatchError(RuntimeError):
    """A torch.distributed collective ran inside an ODC minibatch (ODC_DEBUG_COLLECTIVES)."""


def mode_from_environment() -> Optional[str]:
    """None (off), "raise" or "warn", from $ODC_DEBUG_COLLECTIVES."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value in ("1", "raise", "on", "true", "yes"):
        return "raise"
    if value == "warn":
        return "warn"
    raise ValueError(f"{ENV}={value!r}: expected 0, 1 (raise) or warn")


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
    """Watches one minibatch at a time: start() at minibatch_begin, stop() at its end."""

    def __init__(self, mode: Optional[str]):
        self.mode = mode
        self.seen: List[str] = []
        self._recorder: Optional[_Recorder] = None
        self._warned = set()

    def start(self) -> None:
        if self.mode is None or self._recorder is not None:
            return
        self._recorder = _Recorder(self)
        self._recorder.__enter__()

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
