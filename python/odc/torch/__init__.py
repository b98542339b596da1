"""odc.torch: On-Demand Communication for PyTorch FSDP2 (torch >= 2.9; checked when OdcFSDP is
constructed, so importing this module and `scale_loss` work on any torch 2.x).

Turn ODC on for a model already wrapped with `fully_shard`; keep the model, optimizer and loop:

    comm = odc.torch.comm_from_process_group()                      # e.g. under torchrun
    odc_model = odc.torch.OdcFSDP(model, comm, optimizer)
    with odc_model.minibatch():
        for microbatch in my_microbatches:                            # counts may differ per rank
            odc.torch.scale_loss(loss_sum(microbatch), global_tokens).backward()
    optimizer.step()

Importing this module imports torch; `import odc` alone does not.
"""

try:
    import torch  # noqa: F401
except ImportError as error:  # a readable message instead of a traceback deep inside fsdp2.py
    raise ImportError(
        "odc.torch needs PyTorch (2.9 or newer): pip install 'odc[torch]' (or 'odc[train]' for "
        "python -m odc.train)"
    ) from error

from .debug import CollectiveInMinibatchError  # noqa: E402
from .fsdp2 import (  # noqa: E402
    EngineState,
    GradientsNotReadyError,
    OdcFSDP,
    global_count,
    scale_loss,
    sum_gradients,
)
from .heap import size_nvshmem_heap  # noqa: E402
from .hybrid import node_comm  # noqa: E402
from .lb_mini import LbMiniStep, lb_mini_step  # noqa: E402
from .process_group import comm_from_process_group  # noqa: E402
from . import split  # noqa: E402  (odc.torch.split: the planner's split samples in a loop)

__all__ = [
    "EngineState",
    "OdcFSDP",
    "CollectiveInMinibatchError",
    "GradientsNotReadyError",
    "LbMiniStep",
    "comm_from_process_group",
    "global_count",
    "lb_mini_step",
    "node_comm",
    "scale_loss",
    "split",
    "size_nvshmem_heap",
    "sum_gradients",
]
