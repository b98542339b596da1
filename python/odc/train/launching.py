"""How `python -m odc.train` gets its ranks: it starts them itself (odc.launch, a `file://` store
in a temporary directory), or it is one of them, started by torchrun (env:// rendezvous: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which is how users train.

Either way every run executes `run.run_rank` once per rank and returns rank 0's summary; under
torchrun the summary is broadcast so every rank plans the next run with the same cost model, and
only rank 0 reports (table, JSON, timeline).
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Optional

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_world() -> Optional[int]:
    """WORLD_SIZE when this process was started by torchrun (or any env:// launcher), else None."""
    if not all(name in os.environ for name in _TORCHRUN_VARIABLES):
        return None
    return int(os.environ["WORLD_SIZE"])


class Launcher:
    """Runs `run_rank` for one configuration on every rank; see the module docstring."""

    def __init__(self, device: str):
        self.device = device
        self.world_size = torchrun_world()
        self.torchrun = self.world_size is not None
        self.rank = int(os.environ["RANK"]) if self.torchrun else 0
        self._initialized_here = False

    @property
    def reports(self) -> bool:
        """Whether this process prints the table and writes the files (rank 0 / self-launch)."""
        return self.rank == 0

    def start(self) -> None:
        """Under torchrun: joins the job's process group (env://) once for every run."""
        if not self.torchrun:
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        options = {}
        if self.device == "cuda":
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            options["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", "env://", **options)
        self._initialized_here = True

    def run(self, config, ranks: int, rl=None) -> dict:
        """Rank 0's summary of one run, on every rank (with `rl`, a GRPO run: grpo_run)."""
        import odc

        from .grpo_run import run_grpo_rank
        from .run import default_store_path, run_rank

        fn, extra = (run_rank, ()) if rl is None else (run_grpo_rank, (rl,))
        if not self.torchrun:
            with tempfile.TemporaryDirectory() as directory:
                config.store_path = default_store_path(directory)
                return odc.launch(fn, ranks, config, *extra)[0]
        import torch
        import torch.distributed as dist

        summary = fn(dist.get_rank(), dist.get_world_size(), None, config, *extra)
        box = [summary]
        dist.broadcast_object_list(box, src=0)
        # The next run starts from a clean device, as a self-launched one does (a fresh process).
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return box[0]

    def close(self) -> None:
        if self._initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._initialized_here = False
