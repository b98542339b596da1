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

from .debug import CollectiveInMinibatchError
from .fsdp2 import OdcFSDP, global_count, scale_loss, sum_gradients
from .process_group import comm_from_process_group

__all__ = [
    "OdcFSDP",
    "CollectiveInMinibatchError",
    "comm_from_process_group",
    "global_count",
    "scale_loss",
    "sum_gradients",
]
