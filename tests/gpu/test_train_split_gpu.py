"""Splitting outliers on GPUs: a sample split into zigzag chunks over a group of GPUs
(K/V through odc.torch.split: an odc sub-communicator over the CUDA transport, or an NCCL
subgroup; varlen flash attention with the global causal mask) gives the loss and gradients
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


def _split_rank(rank, world_size, key, store, preset, length, exchanges):
    """Each rank computes the whole sample alone, then the planner's group runs it split with each
    exchange in turn; gradients are summed over ranks on the host (gloo: ranks may share a GPU,
    where NCCL refuses to run)."""
    import torch.distributed as dist

    from odc.torch.split import SplitGroups
    from odc.train.model import build_model, varlen_available

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    backend = "nccl" if "process-group" in exchanges else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
        device_id=device if backend == "nccl" else None,
    )  # fmt: skip
    host = dist.new_group(backend="gloo")  # for the sums checked below, on the host
    try:
        assert varlen_available(device), "torch's varlen attention is missing on this GPU machine"
        with device:
            model = build_model(preset, seed=5).to(torch.bfloat16)
        sample = np.random.default_rng(7).integers(0, model.config.vocab_size, length)
        whole = model(*_inputs(pack([sample]), device))
        whole.backward()
        reference = [p.grad.float().cpu().numpy() for p in model.parameters()]

        splits = odc.plan(
            [length] + [1] * (world_size - 1),
            ranks=world_size,
            max_tokens=length,
            policy="lb-mini",
            cost=(1.0, 1.0, 0.0),
            split="auto",
        )["minibatches"][0]["splits"]
        assert len(splits) == 1, splits
        comm = odc.Comm(rank, world_size, key, timeout=60, device=device.index)
        config = model.config
        kv_width = (
            2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        )
        results = {}
        for exchange in exchanges:
            if exchange == "odc":
                groups = SplitGroups(comm, kv_width=kv_width, dtype=torch.bfloat16)
            else:
                groups = SplitGroups(exchange="process-group")
            groups.prepare(splits)
            model.zero_grad(set_to_none=True)
            loss = torch.zeros((), device=device)
            chunk = groups.chunk(splits[0])
            if chunk is not None:
                loss = model(*_inputs(pack_chunk(sample, chunk.pieces), device), split=chunk)
                loss.backward()
                layers = config.num_hidden_layers  # really exchanged: once per layer each way
                uses = {k: chunk.exchange.uses[k] for k in ("forward", "backward")}
                assert uses == {"forward": layers, "backward": layers}, uses
            torch.cuda.synchronize()
            total = loss.detach().float().cpu()
            dist.all_reduce(total, group=host)
            grads = []
            for p in model.parameters():
                g = p.grad.float().cpu() if p.grad is not None else torch.zeros(p.shape)
                dist.all_reduce(g, group=host)
                grads.append(g.numpy())
            results[exchange] = (float(total), grads)
            groups.close()
        comm.close()
        return float(whole.detach()), reference, results, splits[0]["ranks"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset,length", [("tiny", 1001), ("0.5b", 8191)])
def test_split_sample_on_gpus_equals_the_whole_sample(preset, length):
    """2 ranks sharing one GPU (odc exchange only: NCCL needs a GPU per rank), else up to 4 GPUs
    with both exchanges."""
    gpus = torch.cuda.device_count()
    world_size = max(2, min(gpus, 4))
    exchanges = ("odc", "process-group") if gpus >= world_size else ("odc",)
    with tempfile.TemporaryDirectory() as directory:
        whole, reference, results, group = odc.launch(
            _split_rank, world_size, os.path.join(directory, "store"), preset, length, exchanges
        )[0]
    assert len(group) >= 2 and set(results) == set(exchanges)
    for exchange, (split, grads) in results.items():
        assert split == pytest.approx(whole, rel=1e-2), exchange
        for index, (ours, theirs) in enumerate(zip(grads, reference)):
            scale = float(np.abs(theirs).max()) + 1e-6
            assert float(np.abs(ours - theirs).max()) / scale < 5e-2, (exchange, index)
