"""Peak GPU memory of an `odc train` rank, by phase, for the memory breakdown in the results.

The step loop is cut into phases (minibatch begin, each microbatch, end + optimizer step); each
phase records the memory allocated when it started (what is held across phases: parameters,
optimizer state, gradients so far, odc's scratch) and its peak, so the largest peak splits into
held + transient (activations and FSDP2's communication buffers of that phase). Reading the
allocator's statistics does not synchronize the device. On the CPU the probe records nothing.
"""

from __future__ import annotations

from typing import List, Optional


class MemoryProbe:
    """torch.cuda allocator statistics per phase; `summary()` describes the largest peak."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.phases: List[dict] = []
        self._open: Optional[dict] = None
        self.held_at_last_minibatch = 0

    def enter(self, phase: str, tokens: int = 0) -> None:
        """Closes the current phase and opens `phase` (tokens: of a microbatch)."""
        if not self.on_gpu:
            return
        import torch

        self._close(torch)
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        if phase == "minibatch_begin":
            self.held_at_last_minibatch = held
        self._open = {"phase": phase, "tokens": tokens, "held": held}

    def _close(self, torch) -> None:
        if self._open is not None:
            self._open["peak"] = torch.cuda.max_memory_allocated()
            self.phases.append(self._open)
            self._open = None

    def summary(self) -> dict:
        """Closes the open phase; the largest peak, its phase, and what was held when it began."""
        if not self.on_gpu or (not self.phases and self._open is None):
            return {}
        import torch

        self._close(torch)
        top = max(self.phases, key=lambda p: p["peak"])
        return {
            "torch_peak_bytes": top["peak"],
            "peak_phase": top["phase"],
            "peak_phase_tokens": top["tokens"],
            "held_before_peak_phase_bytes": top["held"],
            "transient_in_peak_phase_bytes": top["peak"] - top["held"],
            "held_at_last_minibatch_begin_bytes": self.held_at_last_minibatch,
            # What torch's caching allocator holds from the driver now (it keeps what it once
            # reserved unless emptied): the driver's view of torch's share, fragmentation included.
            "torch_reserved_bytes": torch.cuda.memory_reserved(),
            "largest_microbatch_tokens": max(
                (p["tokens"] for p in self.phases if p["phase"] == "microbatch"), default=0
            ),
        }
