"""odc.torch on FSDP2 HSDP meshes on the CPU: 2 "nodes" x 2 ranks (gloo across, the host
transport inside each node on a key of its own). LB-Mini plans over all 4 ranks, with different
microbatch counts within and across nodes, equal the single-process reference; with equal
counts ODC hybrid equals plain FSDP2 HSDP. Also the errors a wrong communicator gives."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

from tiny_lm import LR, make_model, max_diff, plans, reference_state, train  # noqa: E402

MESH = (2, 2)  # (replicate, shard): rank = replica * 2 + shard


def test_hybrid_unequal_counts_across_nodes_equal_single_process():
    schedule = plans(4, "lb-mini")  # one plan per minibatch over all ranks of all nodes
    nodes_differ = any(
        sum(len(step[r]) for r in (0, 1)) != sum(len(step[r]) for r in (2, 3))
        or {len(step[r]) for r in range(4)} != {len(step[0])}
        for step in schedule
    )
    assert nodes_differ, "plans must give ranks different microbatch counts"
    results = train(4, schedule, use_odc=True, mesh=MESH)
    counts = [result[0] for result in results]
    assert any(a != b for a, b in zip(counts[0], counts[2])), "nodes must run different counts"
    for result in results:  # every replica ends with the same parameters
        assert max_diff(result[1], reference_state()) < 1e-5


@pytest.mark.long
def test_hybrid_equal_counts_equal_plain_fsdp2_hsdp():
    schedule = plans(4, "lb-micro")  # equal counts: plain FSDP2 HSDP can run it
    odc_state = train(4, schedule, use_odc=True, mesh=MESH)[0][1]
    hsdp_state = train(4, schedule, use_odc=False, mesh=MESH)[0][1]
    # Both sum over all 4 ranks (scale_loss by the job's tokens + sum_gradients): same gradients
    # up to summation order (node sums, then replicas, against FSDP2's reduce-scatter+all-reduce).
    assert max_diff(odc_state, hsdp_state) < 1e-6


def _errors_rank(rank, world_size, key, store_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc.torch

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    messages = {}
    try:
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        swapped = odc.Comm(world_size - 1 - rank, world_size, key + "-swapped", timeout=30)
        try:
            odc.torch.OdcFSDP(model, swapped)
        except odc.InvalidArgument as error:
            messages["shard"] = str(error)
        swapped.close()
        try:
            odc.torch.node_comm(init_device_mesh("cpu", (world_size,)), key)
        except ValueError as error:
            messages["flat"] = str(error)
        # A 1-replica HSDP mesh trains like a flat one; the reduction spans one rank. The key
        # comes from the mesh's store (a key given as before is ignored: it is not job-unique).
        comm = odc.torch.node_comm(mesh, key, timeout=30)
        engine = odc.torch.OdcFSDP(model, comm, torch.optim.AdamW(model.parameters(), lr=LR))
        with engine.minibatch():
            pass
        messages["replicas"] = engine.replica_reduction.num_replicas
        messages["key"], messages["given"] = comm.key, key
        comm.close()
        return messages
    finally:
        dist.destroy_process_group()


def test_errors_name_the_problem():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_errors_rank, 2, os.path.join(directory, "store"), timeout=300)
    for messages in results:
        assert "must span the HSDP mesh's shard dimension" in messages["shard"]
        assert "node_comm(mesh)" in messages["shard"]
        assert "needs a 2-D HSDP mesh" in messages["flat"]
        assert messages["replicas"] == 1
        assert messages["key"].startswith("pg-") and messages["given"] not in messages["key"]
    assert len({messages["key"] for messages in results}) == 1


def _partial_outputs_rank(rank, world_size, key, store_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc.torch
    from tiny_lm import loss_sum, minibatch_samples

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comm = odc.torch.node_comm(mesh, timeout=60)  # no key: the mesh's store gives one
        engine = odc.torch.OdcFSDP(model, comm, torch.optim.AdamW(model.parameters(), lr=LR))
        samples = minibatch_samples(0)
        with engine.minibatch():
            for _ in range(2):  # FSDP2 keeps a partial output per group across microbatches
                odc.torch.scale_loss(loss_sum(model, samples[:2]), 100).backward()
            groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.blocks, model)]
            shared = {
                buffer.untyped_storage().data_ptr() for buffer in engine._hsdp_zero_outputs.values()
            }
            kept = [g._partial_reduce_output for g in groups if g is not None]
            return (
                [None if t is None else t.untyped_storage().data_ptr() in shared for t in kept],
                len(shared),
                comm.key,
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.long
def test_hsdp_partial_outputs_share_one_zero_buffer():
    """FSDP2 keeps every group's reduce-scatter output across the minibatch when its replica
    all-reduce is off; under ODC those outputs are zeros and must all view one shared buffer, not
    hold 4 bytes per parameter element (checked on torch 2.11's FSDPParamGroup)."""
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(
            _partial_outputs_rank, 4, os.path.join(directory, "store"), timeout=300
        )
    for kept, num_shared, _ in results:
        assert num_shared == 1
        assert kept and all(kept), kept
    # Each node's communicator has a key of its own, drawn for this job (rank = replica*2+shard).
    keys = [key for _, _, key in results]
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2], keys
    assert all(key.startswith("pg-") for key in keys), keys
