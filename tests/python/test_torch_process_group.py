"""odc.torch in a user's own job (CPU, gloo + host transport): communicators from the process
group with per-job keys, two concurrent torchrun jobs with default settings, the torchrun example
of docs/torch.md as written, ODC_DEBUG_COLLECTIVES, and what ODC keeps in torch memory."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="odc.torch tests need torch")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "odc_torchrun.py"


def _process_group_rank(rank, world_size, key, store_path):
    import torch.distributed as dist

    import odc.torch
    from odc.torch.process_group import group_store

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        store = group_store(dist.group.WORLD)  # c10d's private group table: must still work
        first = odc.torch.comm_from_process_group(timeout=30)
        second = odc.torch.comm_from_process_group(timeout=30)
        buffer = first.alloc(4)
        buffer.array[:] = rank
        first.barrier()
        out = torch.zeros(4 * world_size).numpy()
        first.gather(out, buffer)
        facts = (first.key, second.key, (first.rank, first.world_size), out.tolist())
        published = store.get("odc/comm_from_process_group/0/key").decode()
        first.close()
        second.close()
        return facts + (published,)
    finally:
        dist.destroy_process_group()


def test_comm_from_process_group_shares_one_fresh_key_per_call():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_process_group_rank, 2, os.path.join(directory, "store"), timeout=300)
    (key0, second0, who0, out0, published0), (key1, second1, who1, out1, _) = results
    assert key0 == key1 == published0 and second0 == second1 and key0 != second0
    assert re.fullmatch(r"pg-[0-9a-f]{32}", key0)
    assert who0 == (0, 2) and who1 == (1, 2)
    assert out0 == out1 == [0.0] * 4 + [1.0] * 4  # the communicator works across the ranks


def _two_hosts_rank(rank, world_size, key, store_path, device):
    import socket

    import torch.distributed as dist

    import odc
    import odc.torch

    socket.gethostname = lambda: f"node{rank}"  # each rank on a host of its own
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        odc.torch.comm_from_process_group(timeout=10, device=device)
    except (RuntimeError, odc.Error) as error:
        return type(error).__name__, str(error)
    finally:
        dist.destroy_process_group()
    return None


def test_comm_from_process_group_across_hosts():
    # Host communicators cannot span hosts: every rank says so. GPU ones go to the NVSHMEM
    # transport over the group's store; without a GPU (or NVSHMEM) that fails naming what is
    # missing, on every rank, instead of waiting out a local rendezvous.
    import odc

    with tempfile.TemporaryDirectory() as directory:
        host = odc.launch(_two_hosts_rank, 2, os.path.join(directory, "a"), None, timeout=300)
        gpu = odc.launch(_two_hosts_rank, 2, os.path.join(directory, "b"), 0, timeout=300)
    for kind, message in host:
        assert kind == "MismatchError"  # an odc.InvalidArgument, still a RuntimeError
        assert "spans 2 hosts (node0, node1)" in message
    if odc.has_cuda() and torch.cuda.device_count() >= 2:
        pytest.skip("GPU machine: the NVSHMEM path is covered by tests/gpu")
    for kind, message in gpu:
        # An odc.Error, of the class its code maps to (no CUDA device: an invalid argument).
        assert issubclass(getattr(odc.errors, kind, type(None)), odc.Error), kind
        assert "nvshmem" in message.lower() or "CUDA device 0 does not exist" in message, message


def test_comm_from_process_group_needs_a_process_group():
    import odc.torch

    with pytest.raises(odc.InvalidUsage, match="needs an initialized torch.distributed"):
        odc.torch.comm_from_process_group()


def _torchrun():
    beside_python = Path(sys.executable).parent / "torchrun"
    path = str(beside_python) if beside_python.is_file() else shutil.which("torchrun")
    if not path:
        pytest.skip("torchrun is not installed")
    return path


@pytest.mark.long
def test_two_concurrent_torchrun_jobs_never_meet(tmp_path):
    """Default settings (--standalone, no run id, no key): each job's key comes from its own
    store, so both finish with the result a single job gets, under different keys."""
    command = [_torchrun(), "--standalone", "--nproc_per_node", "2", str(EXAMPLE)]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=environment,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    lines = []
    for job in jobs:
        stdout, stderr = job.communicate(timeout=600)
        assert job.returncode == 0, stderr[-3000:]
        lines.append(
            re.search(r"odc_torchrun: 2 ranks, key (\S+), parameter checksum (\S+)", stdout)
        )
    assert all(lines), "the example printed no result line"
    (key_a, checksum_a), (key_b, checksum_b) = (m.groups() for m in lines)
    assert key_a != key_b
    # Same seeds, same data: no job saw the other's pushes (a mix would double some sums). The
    # host transport adds pushes in arrival order (streamed), so the last bits may differ.
    assert float(checksum_a) == pytest.approx(float(checksum_b), rel=1e-6, abs=1e-6)


def test_docs_show_the_example_as_written():
    text = (REPO / "docs" / "torch.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert (
        EXAMPLE.read_text() in blocks
    ), "docs/torch.md must show examples/odc_torchrun.py verbatim"


def _debug_rank(rank, world_size, key, store_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from tiny_lm import loss_sum, make_model, minibatch_samples

    import odc.torch
    from odc.torch._sums_pending import SumsPending

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        model = make_model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        os.environ["ODC_DEBUG_COLLECTIVES"] = "1"
        comm = odc.torch.comm_from_process_group(timeout=60)
        optimizer = torch.optim.AdamW(model.parameters())
        engine = odc.torch.OdcFSDP(model, comm, optimizer)
        samples = minibatch_samples(0)
        # A clean minibatch (rank 1 runs one microbatch more): nothing to report.
        with engine.minibatch():
            for sample in samples[: 1 + rank]:
                odc.torch.scale_loss(loss_sum(model, [sample]), 100).backward()
            # No per-microbatch gradient is kept (R5): the sums exist after minibatch_end; .grad
            # is a placeholder without storage until then.
            grads_kept = [
                name
                for name, p in model.named_parameters()
                if p.grad is not None and not isinstance(p.grad.to_local(), SumsPending)
            ]
        clean = engine.collectives_seen
        memory = engine.memory_bytes()
        optimizer.zero_grad(set_to_none=True)  # no step: the next minibatch may drop the sums
        # Every rank makes the same mistake here, so the all-reduce itself would not hang.
        with pytest.raises(odc.torch.CollectiveInMinibatchError) as error:
            with engine.minibatch():
                loss = loss_sum(model, samples[:1])
                dist.all_reduce(loss.detach())
        message = str(error.value)
        # The error left the minibatch: it aborted it (engine failed); a new communicator.
        assert engine.state is odc.torch.EngineState.FAILED
        comm.close()
        comm = odc.torch.comm_from_process_group(timeout=60)
        engine.reset(comm)
        os.environ["ODC_DEBUG_COLLECTIVES"] = "warn"
        model = make_model()  # one engine per model: a second model for the second mode
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        warn_engine = odc.torch.OdcFSDP(model, comm)
        with pytest.warns(RuntimeWarning, match="inside an ODC minibatch"):
            with warn_engine.minibatch():
                loss = odc.torch.scale_loss(loss_sum(model, samples[:1]), 100)
                loss.backward()
                dist.all_reduce(loss.detach())  # e.g. a metric averaged over ranks
        comm.close()
        has_grads_after = all(p.grad is not None for p in model.parameters())
        return clean, message, warn_engine.collectives_seen, grads_kept, has_grads_after, memory
    finally:
        os.environ.pop("ODC_DEBUG_COLLECTIVES", None)
        dist.destroy_process_group()


def test_debug_collectives_names_calls_inside_a_minibatch_and_no_grads_kept_inside():
    import odc

    with tempfile.TemporaryDirectory() as directory:
        results = odc.launch(_debug_rank, 2, os.path.join(directory, "store"), timeout=600)
    for clean, message, warned, grads_kept, has_grads_after, memory in results:
        assert clean == []  # ODC's forward/backward issue no torch.distributed collective
        assert "c10d.allreduce_" in message and "minibatch_end" in message
        assert warned and all(op.startswith(("c10d.", "_c10d_functional.")) for op in warned)
        assert grads_kept == []  # inside a minibatch: no per-microbatch gradient memory
        assert has_grads_after  # after minibatch_end: .grad views the sums
        assert set(memory) == {
            "published",
            "published_in_place",
            "accumulators",
            "scheme",
            "node_cache",
            "total",
        }
        assert 0 < memory["published"] and 0 < memory["accumulators"]
        # The host transport streams: its staging rings, at most the default budget (256 MiB).
        assert 0 < memory["scheme"] <= 256 << 20
