"""The two invariants odc.torch rests on, checked on the CPU (gloo + host transport, 2 ranks):
1. no process-group collective is issued during forward/backward under ODC, even when the ranks
   run different numbers of microbatches (counted at the torch.distributed Python level and at
   the c10d operator level; plain FSDP2 on the same model is the positive control);
2. every ODC gather yields exactly the bytes FSDP2's own all-gather yields from FSDP2's own
   all-gather input (fp32 and bf16 parameters).
Self-contained: the counting and the byte comparison are done by wrappers in this file."""

import contextlib
import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

from tiny_lm import loss_sum, make_model, minibatch_samples  # noqa: E402

# Per minibatch of 8 samples, each rank's microbatches (sample indices).
UNEVEN = [[[0, 1], [2], [3, 4]], [[5, 6, 7]]]  # rank 0: 3 microbatches, rank 1: 1
IDLE = [[[0, 1, 2, 3], [4, 5, 6, 7]], []]  # rank 1 runs none at all
EQUAL = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # 2 + 2: FSDP2's own all-gather can run beside

# Every collective entry point of torch.distributed a forward/backward could reach.
_DIST_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "_all_gather_base",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "scatter",
    "send",
)


class _CollectiveCounter:
    """Records every collective issued while active: calls of torch.distributed's collective
    functions (wrapped in torch.distributed and torch.distributed.distributed_c10d) and c10d /
    functional-collective operators reaching the dispatcher (which also catches calls made
    directly on a ProcessGroup)."""

    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def active(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor

                if any(t is DTensor for t in types):  # let DTensor lower to what we count
                    return NotImplemented
                name = func.__name__.split(".")[0]
                if func.namespace in (
                    "c10d",
                    "_c10d_functional",
                    "c10d_functional",
                ) and name not in (
                    "wait_tensor",
                    "_wrap_tensor_autograd",
                ):
                    counter.calls.append(f"op:{name}")
                return func(*args, **(kwargs or {}))

        def wrap(name, original):
            def wrapper(*args, **kwargs):
                counter.calls.append(f"dist.{name}")
                return original(*args, **kwargs)

            return wrapper

        saved = []
        for module in (dist, c10d):
            for name in _DIST_COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    saved.append((module, name, original))
                    setattr(module, name, wrap(name, original))
        try:
            with Ops():
                yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


def _shard(model, bf16):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _run_minibatch(model, samples, microbatches, scale_loss):
    tokens = sum(int(t.shape[1]) - 1 for t in samples)
    for indices in microbatches:
        scale_loss(loss_sum(model, [samples[i] for i in indices]), tokens).backward()


def _checks_rank(rank, world_size, key, store_path, bf16):
    import torch.distributed as dist

    import odc
    import odc.torch
    from odc.torch import fsdp2 as odc_fsdp2

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    result = {"gathers": 0, "pushes": 0, "verified": 0, "mismatched": 0}
    verify = [False]
    original_gather = odc_fsdp2.OdcAllGather.__call__
    # Every push, whether FSDP2's reduce called the custom reduce-scatter or the group's
    # post_backward pushed without FSDP2's bookkeeping (_fsdp2_internals R12).
    original_push = odc_fsdp2.OdcReduceScatter.push

    def gather(self, output_tensor, input_tensor, group, async_op=False):
        # input_tensor is FSDP2's copy-in of this rank's shard, a view into output_tensor at
        # rank * S: keep its bytes before the gather rewrites that slot.
        fsdp_input = input_tensor.clone() if verify[0] else None
        handle = original_gather(self, output_tensor, input_tensor, group, async_op)
        result["gathers"] += 1
        if verify[0]:
            expected = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(expected, fsdp_input, group=group)
            same = torch.equal(expected.view(torch.uint8), output_tensor.view(torch.uint8))
            result["verified" if same else "mismatched"] += 1
        return handle

    def push(self, *args, **kwargs):
        result["pushes"] += 1
        return original_push(self, *args, **kwargs)

    odc_fsdp2.OdcAllGather.__call__ = gather
    odc_fsdp2.OdcReduceScatter.push = push
    # The verifier's own all-gathers run inside minibatches on purpose: odc.torch's check would
    # (rightly) raise at their end. Part 1 counts collectives itself.
    os.environ["ODC_DEBUG_COLLECTIVES"] = "0"
    try:
        model = _shard(make_model(), bf16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        comm = odc.Comm(rank, world_size, key, timeout=60)
        engine = odc.torch.OdcFSDP(model, comm, optimizer)

        # 1. Uneven and idle ranks: no collective inside the minibatch.
        counter = _CollectiveCounter()
        for step, schedule in enumerate((UNEVEN, IDLE, UNEVEN)):
            samples = minibatch_samples(step)
            engine.minibatch_begin()
            with counter.active():
                _run_minibatch(model, samples, schedule[rank], odc.torch.scale_loss)
            engine.minibatch_end()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # outside: may collect
            optimizer.step()
            optimizer.zero_grad()
        result["odc_collectives"] = counter.calls
        result["odc_microbatches"] = sum(len(s[rank]) for s in (UNEVEN, IDLE, UNEVEN))

        # 2. Equal counts: FSDP2's own all-gather of its own input beside every ODC gather.
        verify[0] = True
        engine.minibatch_begin()
        _run_minibatch(model, minibatch_samples(9), EQUAL[rank], odc.torch.scale_loss)
        engine.minibatch_end()
        verify[0] = False
        comm.close()

        # Positive control: the same counter sees plain FSDP2's per-layer collectives.
        plain = _shard(make_model(), bf16)
        odc.torch.sum_gradients(plain)
        control = _CollectiveCounter()
        with control.active():
            _run_minibatch(plain, minibatch_samples(0), EQUAL[rank][:1], odc.torch.scale_loss)
        result["fsdp2_collectives"] = control.calls
        return result
    finally:
        odc_fsdp2.OdcAllGather.__call__ = original_gather
        odc_fsdp2.OdcReduceScatter.push = original_push
        dist.destroy_process_group()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_no_collective_in_minibatch_and_gathers_equal_fsdp2_all_gather(bf16):
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_checks_rank, 2, os.path.join(directory, "store"), bf16, timeout=300)
    for rank, result in enumerate(results):
        # The counter works: plain FSDP2 all-gathers and reduce-scatters per layer.
        control = result["fsdp2_collectives"]
        assert "dist.all_gather_into_tensor" in control and "dist.reduce_scatter_tensor" in control
        assert any(call.startswith("op:") for call in control), control
        # ODC ran its gathers and pushes in those minibatches, and issued no collective.
        assert result["odc_microbatches"] > 0 and result["gathers"] > 0 and result["pushes"] > 0
        assert result["odc_collectives"] == [], f"rank {rank}: {result['odc_collectives']}"
        # Every gather of the verified minibatch: FSDP2's all-gather bytes, exactly.
        assert result["mismatched"] == 0, f"rank {rank}: {result}"
        assert result["verified"] >= 2 * 3, f"rank {rank}: {result}"  # 2 microbatches, 3 groups
