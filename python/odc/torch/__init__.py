"""odc.torch: On-Demand Communication for PyTorch FSDP2 (torch 2.11).

Turn ODC on for a model already wrapped with `fully_shard`; keep the model, optimizer and loop:

    comm = odc.Comm(rank, world_size, key, device=local_rank)      # or a host Comm on CPU
    odc_model = odc.torch.OdcFSDP(model, comm, optimizer)
    with odc_model.minibatch():
        for microbatch in my_microbatches:                            # counts may differ per rank
            odc.torch.scale_loss(loss_sum(microbatch), global_tokens).backward()
    optimizer.step()

Importing this module imports torch; `import odc` alone does not.
"""

from .fsdp2 import OdcFSDP, global_count, scale_loss, sum_gradients
from .hybrid import node_comm

__all__ = ["OdcFSDP", "global_count", "node_comm", "scale_loss", "sum_gradients"]
