"""odc.torch on the CPU (gloo + host transport): FSDP2 models trained with ODC, ranks running
different numbers of microbatches from LB-Mini plans, equal a single-process reference; with equal
counts they equal plain FSDP2. Also mixed precision, reshard_after_forward=False, clipping, a
torch.distributed.checkpoint round trip, and the errors users get."""

import os
import tempfile

import pytest


torch = pytest.importorskip("torch", reason="odc.torch tests need torch")


from tiny_lm import (  # noqa: E402
    LR,
    loss_sum,
    make_model,
    max_diff,
    minibatch_samples,
    plans,
    reference_state,
    train,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_unequal_microbatch_counts_equal_single_process(world_size):
    schedule = plans(world_size, "lb-mini")
    results = train(world_size, schedule, use_odc=True)
    counts_per_rank = [result[0] for result in results]
    assert any(len(set(step)) > 1 for step in zip(*counts_per_rank)), "plans must be uneven"
    state = results[0][1]
    assert max_diff(state, reference_state()) < 1e-5


def test_equal_counts_equal_plain_fsdp2_and_checkpoint_round_trip():
    schedule = plans(2, "lb-micro")  # equal counts: plain FSDP2 can run it
    odc_state = train(2, schedule, use_odc=True, checkpoint=True)[0][1]
    fsdp2_state = train(2, schedule, use_odc=False)[0][1]
    assert max_diff(odc_state, fsdp2_state) < 1e-6
    assert max_diff(odc_state, reference_state()) < 1e-5


def test_bf16_mixed_precision_and_no_reshard_match_plain_fsdp2():
    schedule = plans(2, "lb-micro")
    options = dict(bf16=True, reshard_after_forward=False)
    odc_state = train(2, schedule, use_odc=True, **options)[0][1]
    fsdp2_state = train(2, schedule, use_odc=False, **options)[0][1]
    # Same bf16 compute, same fp32 sums (up to summation order).
    assert max_diff(odc_state, fsdp2_state) < 1e-5


def _errors_rank(rank, world_size, key, store_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc.torch

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    messages = {}
    try:
        model = make_model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # A communicator whose ranks are not the mesh's.
        swapped = odc.Comm(world_size - 1 - rank, world_size, key + "-swapped", timeout=30)
        try:
            odc.torch.OdcFSDP(model, swapped)
        except odc.InvalidArgument as error:  # a communicator that does not fit the mesh
            messages["mesh"] = str(error)
            messages["mesh_runtime"] = isinstance(error, RuntimeError)  # as it was before
        swapped.close()
        comm = odc.Comm(rank, world_size, key, timeout=30)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)
        engine.minibatch_begin()
        odc.torch.scale_loss(loss_sum(model, minibatch_samples(0)[:1]), 10).backward()
        try:
            optimizer.step()
        except odc.InvalidUsage as error:  # the right call at the wrong moment
            messages["step"] = str(error)
        engine.minibatch_end()
        optimizer.step()
        # Outside a minibatch a forward gathers as FSDP2 does (collective, after every step).
        messages["outside"] = float(loss_sum(model, minibatch_samples(0)[:1]))
        comm.close()
        # Closed under the engine (not through offload()): the error names the way back, and
        # taking it (reset onto a new communicator) trains again.
        try:
            engine.minibatch_begin()
        except odc.InvalidUsage as error:
            messages["closed"] = str(error)
        engine.reset(odc.Comm(rank, world_size, key + "-new", timeout=30))
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, minibatch_samples(1)[rank::2]), 10).backward()
        optimizer.step()
        messages["after_reset"] = engine.comm.closed
        engine.comm.close()
        return messages
    finally:
        dist.destroy_process_group()


def test_errors_name_the_problem():
    from torch import nn

    import odc.torch
    from odc.torch import _fsdp2_internals

    with pytest.raises(TypeError, match="wrapped with fully_shard"):
        odc.torch.OdcFSDP(nn.Linear(2, 2), comm=None)
    with pytest.raises(
        odc.InvalidUsage, match=r"lacks \(FSDPModule.set_custom_all_gather.*torch >= 2.9"
    ):
        _fsdp2_internals.check_fsdp2_support(
            type("OldFSDPModule", (), {"reshard": lambda self: None})
        )
    with pytest.raises(ValueError, match="global_tokens must be positive"):
        odc.torch.scale_loss(torch.ones(()), 0)
    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_errors_rank, 2, os.path.join(directory, "store"), timeout=300)
    for messages in results:
        assert "does not match the odc communicator" in messages["mesh"]
        assert messages["mesh_runtime"]
        assert "before minibatch_end()" in messages["step"]
        assert messages["outside"] > 0
        assert "communicator was closed (comm.close()): call engine.reset(" in messages["closed"]
        assert messages["after_reset"] is False


def _in_place_rank(rank, world_size, key, store_path):
    """FSDP2's sharded parameters live in odc's published buffers (R7): no second copy."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc.torch

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        model = make_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        engine = odc.torch.OdcFSDP(model, odc.Comm(rank, world_size, key, timeout=60), optimizer)
        memory = engine.memory_bytes()
        spans = []
        for group in engine._groups:
            flat = group.published.tensor()
            spans.append((flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()))
        outside = [
            name
            for name, p in model.named_parameters()
            if p.to_local().numel()
            and not any(lo <= p.to_local().data_ptr() < hi for lo, hi in spans)
        ]
        samples = minibatch_samples(0)
        with engine.minibatch():
            odc.torch.scale_loss(loss_sum(model, samples[rank::world_size]), 100).backward()
        optimizer.step()
        # The step wrote the published shards themselves: the next gathers see it unpublished.
        flat = engine._groups[0].published.tensor()
        slot = engine._groups[0].layout.slots[0]
        stepped = torch.equal(
            flat[slot.offset : slot.offset + slot.local_numel],
            slot.param.to_local().detach().reshape(-1),
        )
        # A shard FSDP2 moved out (as reset_sharded_param does after load_state_dict on torch 2.9)
        # and changed there comes back, with its new values, at the next minibatch_begin.
        from odc.torch import _fsdp2_internals as internals

        group = engine._groups[0]
        elsewhere = torch.zeros(slot.padded_numel)
        internals.alias_sharded_param(group.layout.module, 0, elsewhere)
        with torch.no_grad():
            slot.param.to_local().fill_(0.5)
        engine.minibatch_begin()
        engine.minibatch_end()
        local = slot.param.to_local()
        moved_back = bool(
            local.numel() == 0
            or (
                flat.data_ptr() <= local.data_ptr() < spans[0][1]
                and torch.all(flat[slot.offset : slot.offset + slot.local_numel] == 0.5)
            )
        )
        return memory, outside, stepped, moved_back, [g.published.dtype for g in engine._groups]
    finally:
        dist.destroy_process_group()


def test_sharded_parameters_live_in_the_published_buffers():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_in_place_rank, 2, os.path.join(directory, "store"), timeout=300)
    for memory, outside, stepped, moved_back, dtypes in results:
        assert memory["published_in_place"] == memory["published"] > 0
        assert outside == [], f"parameters outside the published buffers: {outside}"
        assert stepped
        assert moved_back
        assert set(dtypes) == {"float32"}  # float32 shards, pulled then cast to bfloat16


def _narrowing_rank(rank, world_size, key, numel):
    import odc

    generator = torch.Generator().manual_seed(numel + rank)
    values = torch.randn(numel, generator=generator) * 1e3
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.3895e38])
    values[: min(numel, len(specials))] = specials[: min(numel, len(specials))]
    with odc.Comm(rank, world_size, key, timeout=60) as comm:
        shard = comm.alloc(numel)
        shard.array[:] = values.numpy()
        comm.barrier()
        out = torch.empty(world_size * numel, dtype=torch.bfloat16)
        comm.gather(out.view(torch.uint16).numpy(), shard)
        comm.barrier()
    return out.view(torch.int16).numpy().copy(), values.numpy().copy()


@pytest.mark.parametrize("numel", [1, 1000, (1 << 21) + 3])
def test_narrowing_gather_equals_a_torch_cast(numel):
    """odc.torch gathers float32 shards straight into FSDP2's bfloat16 output: every element must
    round as Tensor.to(torch.bfloat16) does (infinities, -0, subnormals and the largest finite
    included; NaN stays NaN), or ODC and FSDP2 would train on different weights."""
    import odc

    results = odc.launch(_narrowing_rank, 2, numel, timeout=120)
    expected = torch.cat([torch.from_numpy(values) for _, values in results]).to(torch.bfloat16)
    nan = torch.isnan(expected)
    for out, _ in results:
        got = torch.from_numpy(out)
        # NaN stays NaN (its payload bits differ between torch's own CPU and CUDA casts too).
        assert torch.equal(torch.isnan(got.view(torch.bfloat16)), nan)
        assert torch.equal(got[~nan], expected.view(torch.int16)[~nan])
