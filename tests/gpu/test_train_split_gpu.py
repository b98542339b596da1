"""Splitting outliers on GPUs (issue #14): a sample split into zigzag chunks over a group of GPUs
(K/V exchanged through an NCCL subgroup all-gather, or pulled from odc symmetric buffers over the
CUDA transport; varlen flash attention with the global causal mask) gives the loss and gradients
of the same sample run whole on one GPU, within bf16 tolerance, with either exchange.

Tolerance: both sides run in bf16 with fp32 loss accumulation; they differ in summation order
(attention split by pieces, gradients summed over members), so the loss must agree to 1e-2
relative and every parameter's gradient to 5e-2 of its largest entry (the packed-attention GPU
test's bounds)."""

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers")

import odc  # noqa: E402
from odc.train.data import pack, pack_chunk  # noqa: E402


def _inputs(packed, device):
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return (
        t(packed.input_ids), t(packed.position_ids), t(packed.labels), t(packed.boundaries),
        packed.longest,
    )  # fmt: skip


def _split_rank(rank, world_size, key, store, preset, length):
    import torch.distributed as dist

    from odc.train.model import OdcKVExchange, SplitChunk, build_model, varlen_available

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world_size, device_id=device
    )
    try:
        assert varlen_available(device), "torch's varlen attention is missing on this GPU machine"
        with device:
            model = build_model(preset, seed=5).to(torch.bfloat16)
        sample = np.random.default_rng(7).integers(0, model.config.vocab_size, length)
        whole = model(*_inputs(pack([sample]), device))
        whole.backward()
        reference = [p.grad.float().cpu().numpy() for p in model.parameters()]
        model.zero_grad(set_to_none=True)

        splits = odc.plan(
            [length] + [1] * (world_size - 1),
            ranks=world_size,
            max_tokens=length,
            policy="lb-mini",
            cost=(1.0, 1.0, 0.0),
            split="auto",
        )["minibatches"][0]["splits"]
        assert len(splits) == 1, splits
        split = splits[0]
        group = dist.new_group(split["ranks"])
        comm = odc.Comm(rank, world_size, key, timeout=60, device=rank)
        config = model.config
        width = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        rows = max(sum(e - b for b, e in c) for c in split["chunks"])
        exchanges = {
            "nccl": None,  # every rank allocates the odc buffers (collective), members use them
            "odc": OdcKVExchange(comm, group, split["ranks"], rows, width, torch.bfloat16),
        }
        results, chunk = {}, None
        for name, exchange in exchanges.items():
            model.zero_grad(set_to_none=True)
            loss = torch.zeros((), device=device)
            if rank in split["ranks"]:
                member = split["ranks"].index(rank)
                chunk = SplitChunk(group, member, split["chunks"], length, exchange)
                packed = pack_chunk(sample, split["chunks"][member])
                loss = model(*_inputs(packed, device), split=chunk)
                loss.backward()
                if exchange is not None:  # really through odc: one exchange per layer each way
                    layers = config.num_hidden_layers
                    assert exchange._uses == {"forward": layers, "backward": layers}
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            grads = []
            for p in model.parameters():
                g = (
                    p.grad.float()
                    if p.grad is not None
                    else torch.zeros_like(p, dtype=torch.float32)
                )
                dist.all_reduce(g)
                grads.append(g.cpu().numpy())
            results[name] = (float(total), grads)
        torch.cuda.synchronize()
        dist.barrier()  # nobody frees the odc buffers while a member may still pull
        del exchanges, chunk
        comm.close()
        return float(whole.detach()), reference, results, split["ranks"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset,length", [("tiny", 1001), ("0.5b", 8191)])
def test_split_sample_on_gpus_equals_the_whole_sample(preset, length):
    world_size = min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as directory:
        whole, reference, results, group = odc.launch(
            _split_rank, world_size, os.path.join(directory, "store"), preset, length
        )[0]
    assert len(group) >= 2
    for exchange, (split, grads) in results.items():
        assert split == pytest.approx(whole, rel=1e-2), exchange
        for index, (ours, theirs) in enumerate(zip(grads, reference)):
            scale = float(np.abs(theirs).max()) + 1e-6
            assert float(np.abs(ours - theirs).max()) / scale < 5e-2, (exchange, index)
