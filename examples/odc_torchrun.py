"""odc.torch in your own torchrun job: FSDP2 + ODC, ranks running different microbatch counts.

torchrun --standalone --nproc_per_node 2 examples/odc_torchrun.py   # gloo on CPU, NCCL on GPUs
"""

import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import odc
import odc.torch


def main():
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if on_gpu else "cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    blocks = [nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16)) for _ in range(3)]
    model = nn.Sequential(*blocks).to(device)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = odc.torch.comm_from_process_group()  # its key comes from this job's store
    engine = odc.torch.OdcFSDP(model, comm, optimizer)

    for step in range(4):
        # A minibatch of samples of different lengths (the same on every rank: seeded).
        generator = torch.Generator().manual_seed(step)
        lengths = torch.randint(1, 48, (6 * world,), generator=generator).tolist()
        inputs = [torch.randn(n, 16, generator=generator) for n in lengths]
        # samples_per_rank=None: these 6 x world samples are one minibatch (default: 4 per rank)
        plan = odc.plan(
            lengths, ranks=world, max_tokens=64, policy="lb-mini", samples_per_rank=None
        )
        mine = plan["minibatches"][0]["ranks"][rank]["microbatches"]  # counts differ by rank
        tokens = sum(lengths)  # the whole minibatch's: known from the plan, no collective
        with engine.minibatch():
            for microbatch in mine:
                x = torch.cat([inputs[i] for i in microbatch]).to(device)
                loss_sum = (model(x) - torch.sin(x)).pow(2).sum()
                odc.torch.scale_loss(loss_sum, tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after the minibatch: safe
        optimizer.step()
        optimizer.zero_grad()

    checksum = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    if rank == 0:
        print(f"odc_torchrun: {world} ranks, key {comm.key}, parameter checksum {checksum:.9e}")
    comm.close()
    # Drop what still refers to the process group (FSDP2's state holds its last collectives) before
    # destroying it, so gloo's worker threads are joined while Python is alive: one that
    # releases a tensor during interpreter shutdown aborts the process (a known torch race).
    del engine, optimizer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
