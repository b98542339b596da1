"""NVSHMEM's heap sized to the model (odc.nvshmem_heap, odc.torch.size_nvshmem_heap) on the CPU:
the arithmetic of what odc puts on the heap, the decisions (user's setting kept, a reserved heap
never resized), and the need computed from an FSDP2 model equal to what OdcFSDP allocates."""

import math
import os
import tempfile

import pytest

from odc import nvshmem_heap as heap
from odc.errors import InvalidArgument, InvalidUsage

GIB, MIB = 1 << 30, 1 << 20


KNOBS = (
    "ODC_STAGING_BYTES",
    "ODC_NODE_CACHE_BYTES",
    "ODC_NODE_AGGREGATION_BYTES",
    "ODC_LOCAL_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "ODC_NVSHMEM_HEAP_GIB",
    "NVSHMEM_SYMMETRIC_SIZE",
)


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    monkeypatch.setattr(heap, "_reserved_bytes", None)
    monkeypatch.setattr(heap, "_sized_bytes", None)
    for knob in KNOBS:  # the library reads the process's environment (heap_need)
        monkeypatch.delenv(knob, raising=False)


def _with_env(monkeypatch, env):
    for knob in KNOBS:
        monkeypatch.delenv(knob, raising=False)
    for knob, value in env.items():
        monkeypatch.setenv(knob, value)


def test_need_by_kind_and_margin(monkeypatch):
    published, elements = 3 * GIB, 3 * GIB // 4 * 2  # accumulators 6 GiB (fp32 of 2x elements)
    flat = heap.heap_need(published, elements, 4, 4)  # one node: no node schemes
    assert (flat.published, flat.accumulators) == (3 * GIB, 6 * GIB)
    assert flat.staging == 256 * MIB and flat.node_cache == flat.aggregation == 0
    assert flat.deterministic == 0
    assert flat.subtotal == 9 * GIB + 256 * MIB
    assert flat.total % (64 * MIB) == 0
    assert flat.subtotal * 1.05 + 64 * MIB <= flat.total < flat.subtotal * 1.05 + 128 * MIB
    assert flat.margin == flat.total - flat.subtotal

    # 2 nodes of 2: the cache holds one remote node's shards, at most its budget; aggregation off
    # by default, on with a budget: one relay row of the accumulators, at most the budget.
    nodes = heap.heap_need(published, elements, 4, 2)
    assert nodes.node_cache == 256 * MIB and nodes.aggregation == 0
    _with_env(monkeypatch, {"ODC_NODE_CACHE_BYTES": "8G", "ODC_NODE_AGGREGATION_BYTES": "1G"})
    both = heap.heap_need(published, elements, 4, 2)
    assert both.node_cache == 3 * GIB and both.aggregation == GIB
    # 4 nodes of 1: three rows each; aggregation needs several ranks per node (the core's rule).
    ones = heap.heap_need(MIB, 1024, 4, 1)
    assert ones.node_cache == 3 * MIB and ones.aggregation == 0
    # Explicit budgets win over the environment; the staging budget is the communicator's.
    given = heap.heap_need(0, 0, 4, 2, staging_bytes=MIB, node_cache_bytes=0)
    assert (given.staging, given.node_cache) == (MIB, 0)
    _with_env(monkeypatch, {"ODC_NODE_CACHE_BYTES": "0"})
    assert heap.heap_need(0, 0, 4, 2).node_cache == 0
    # Deterministic: 4 S N per accumulator plus the scheme's scratch.
    _with_env(monkeypatch, {})
    det = heap.heap_need(0, 1000, 4, 4, deterministic=True)
    assert det.deterministic == 4 * 1000 * 4 + 4 * MIB
    # Nodes from the environment as the core reads them, ODC_LOCAL_WORLD_SIZE first.
    _with_env(monkeypatch, {"ODC_LOCAL_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"})
    assert heap.heap_need(MIB, 0, 4).node_cache == MIB
    _with_env(monkeypatch, {"LOCAL_WORLD_SIZE": "4"})
    assert heap.heap_need(MIB, 0, 4).node_cache == 0


def test_knob_parsing(monkeypatch):
    # The library parses the budgets (one parser: src/common/env.h's parse_count): whatever it
    # refuses is refused here, naming the knob.
    _with_env(monkeypatch, {"ODC_NODE_CACHE_BYTES": "256M"})
    assert heap.heap_need(MIB, 0, 2, 1).node_cache == MIB
    for text in (" 5", "5 ", "\u0665", "+5", "1_0", "5KB", str(2**64), "17179869184G"):
        _with_env(monkeypatch, {"ODC_NODE_CACHE_BYTES": text})
        with pytest.raises(InvalidArgument, match="is not a number of bytes"):
            heap.heap_need(0, 0, 2, 1)
    _with_env(monkeypatch, {"ODC_STAGING_BYTES": "lots"})
    with pytest.raises(InvalidArgument, match="ODC_STAGING_BYTES='lots'"):
        heap.heap_need(0, 0, 2, 2)
    _with_env(monkeypatch, {})
    assert heap.parse_nvshmem_size("4G") == 4 * GIB
    assert heap.parse_nvshmem_size("1073741824") == GIB
    assert heap.parse_nvshmem_size("512m") == 512 * MIB
    assert heap.configured_heap({}) == (4 * GIB, "default")
    assert heap.configured_heap({"ODC_NVSHMEM_HEAP_GIB": "1.5"}) == (3 * GIB // 2, heap.HEAP_KNOB)
    both = {"ODC_NVSHMEM_HEAP_GIB": "8", "NVSHMEM_SYMMETRIC_SIZE": "2G"}
    assert heap.configured_heap(both) == (2 * GIB, heap.NVSHMEM_KNOB)


def test_size_heap_sets_raises_keeps_and_leaves_the_users():
    env = {}
    small = heap.heap_need(GIB, 0, 4, 4)
    sized = heap.size_heap(small, env)
    assert sized.action == "sized" and sized.heap_bytes == small.total
    # The size odc.Comm passes to the first NVSHMEM communicator (nvshmem_heap_bytes); the
    # environment is never written.
    assert heap.sized_heap_bytes() == small.total and env == {}
    assert "ODC_NVSHMEM_HEAP_GIB" not in os.environ
    assert heap.size_heap(small, env).action == "kept"
    large = heap.heap_need(10 * GIB, 0, 4, 4)
    assert heap.size_heap(large, env).action == "sized"
    assert heap.sized_heap_bytes() == large.total
    assert heap.size_heap(small, env).action == "kept"  # never shrunk by a smaller need

    for user in ({"ODC_NVSHMEM_HEAP_GIB": "64"}, {"NVSHMEM_SYMMETRIC_SIZE": "64G"}):
        before = dict(user)
        assert heap.size_heap(large, user).action == "user"
        assert user == before
    with pytest.warns(UserWarning, match=r"ODC_NVSHMEM_HEAP_GIB gives 2.00 GiB"):
        assert heap.size_heap(large, {"ODC_NVSHMEM_HEAP_GIB": "2"}).action == "user"


def test_a_reserved_heap_is_never_resized(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    monkeypatch.delenv("ODC_NVSHMEM_HEAP_GIB", raising=False)
    heap.note_nvshmem_started()  # as odc.Comm does after its first NVSHMEM communicator
    assert heap.reserved_heap_bytes() == 4 * GIB
    fits = heap.heap_need(GIB, 0, 4, 4)
    assert heap.size_heap(fits).action == "reserved"
    need = heap.heap_need(5 * GIB, 0, 4, 4)
    with pytest.raises(InvalidUsage) as raised:
        heap.size_heap(need)
    message = str(raised.value)
    gib = math.ceil(need.total / GIB * 16) / 16
    assert f"ODC_NVSHMEM_HEAP_GIB={gib:g}" in message
    assert f"NVSHMEM_SYMMETRIC_SIZE={need.total}" in message
    assert "reserved its heap at 4.00 GiB" in message and "shards 5.00" in message
    assert "ODC_NVSHMEM_HEAP_GIB" not in os.environ  # nothing changed behind the user's back


def test_a_reserved_heap_short_only_of_the_budgets_warns(monkeypatch):
    # The budgets (staging, node schemes) are upper bounds and NVSHMEM may not enforce its size:
    # a heap holding the shards and accumulators but not the budgets warns and goes on.
    need = heap.heap_need(GIB, GIB // 4, 4, 2, node_aggregation_bytes=GIB)
    monkeypatch.setattr(heap, "_reserved_bytes", need.published + need.accumulators + 1)
    with pytest.warns(UserWarning, match="going on: the budgets may fit"):
        heap.check_reserved(need)
    monkeypatch.setattr(heap, "_reserved_bytes", need.published + need.accumulators - 1)
    with pytest.raises(InvalidUsage, match="reserved its heap at"):
        heap.check_reserved(need)


def test_deterministic_needs_no_staging_or_relays():
    need = heap.heap_need(GIB, GIB // 4, 4, 2, deterministic=True)
    assert need.staging == 0 and need.aggregation == 0 and need.deterministic > 0


torch = pytest.importorskip("torch", reason="odc.torch tests need torch")


def _need_rank(rank, world_size, key, store_path, reserved):
    """The need from the model equals what OdcFSDP allocates; over a heap reserved too small
    (pretended: a host communicator marked as NVSHMEM's), OdcFSDP refuses before allocating."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import odc
    import odc.torch
    from odc import nvshmem_heap
    from odc.torch import heap as torch_heap
    from tiny_lm import make_model

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        model = make_model()
        model.blocks[0].requires_grad_(False)  # frozen: no accumulator for it
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        need = torch_heap.layouts_need(torch_heap.model_layouts(model), world_size, world_size)
        comm = odc.Comm(rank, world_size, key, timeout=60)
        if reserved:
            nvshmem_heap._reserved_bytes = need.published + need.accumulators - 1
            comm._nvshmem = True
            try:
                odc.torch.OdcFSDP(model, comm)
            except odc.Error as error:
                return str(error), comm.memory_bytes()["buffers"]
            return None, None
        engine = odc.torch.OdcFSDP(model, comm)
        memory = engine.memory_bytes()
        return (need.published, need.accumulators), (memory["published"], memory["accumulators"])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_need_equals_what_odc_torch_allocates(world_size):
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(
            _need_rank, world_size, os.path.join(directory, "store"), False, timeout=300
        )
    for need, allocated in results:
        assert need == allocated and need[1] > 0


def test_odc_torch_refuses_a_model_larger_than_the_reserved_heap():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_need_rank, 2, os.path.join(directory, "store"), True, timeout=300)
    for message, allocated in results:
        assert message is not None and "ODC_NVSHMEM_HEAP_GIB=" in message, message
        assert "of NVSHMEM symmetric heap per GPU" in message
        assert allocated == 0  # refused before any buffer
