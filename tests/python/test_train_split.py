"""Splitting outliers in odc.train: a sample split into zigzag chunks over a group of
ranks gives exactly the loss and every gradient of the same sample run whole on one rank (CPU,
fp32, gloo), and the runtime follows the planner's "splits" entries."""

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="split attention needs torch")
pytest.importorskip("transformers", reason="the packed model needs transformers")

import odc  # noqa: E402
from odc.train.data import IGNORE_INDEX, pack, pack_chunk  # noqa: E402


def _inputs(packed):
    t = torch.from_numpy
    return (
        t(packed.input_ids),
        t(packed.position_ids),
        t(packed.labels),
        t(packed.boundaries),
        packed.longest,
    )


def _split_rank(rank, world_size, key, store, length, exchange="nccl"):
    """Every rank computes the whole sample's loss and gradients alone, then the group runs it
    split (zigzag) and sums the members' gradients; returns both on rank 0. K/V move through a
    gloo subgroup (exchange "nccl") or odc pulls over the shared-memory transport ("odc")."""
    import torch.distributed as dist

    from odc.torch.split import SplitGroups
    from odc.train.model import build_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = build_model("tiny", seed=5)
        sample = np.random.default_rng(7).integers(0, 1024, length)
        whole = model(*_inputs(pack([sample])))
        whole.backward()
        reference = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

        splits = odc.plan(
            [length, 1, 1],
            ranks=world_size,
            max_tokens=length,
            policy="lb-mini",
            cost=(1.0, 1.0, 0.0),
            split="auto",
        )["minibatches"][0]["splits"]
        assert len(splits) == 1, splits
        split = splits[0]
        comm = None
        if exchange == "odc":
            comm = odc.Comm(rank, world_size, key, timeout=60)
            config = model.config
            head_dim = config.hidden_size // config.num_attention_heads
            groups = SplitGroups(
                comm, kv_width=2 * config.num_key_value_heads * head_dim, dtype=torch.float32
            )
        else:
            groups = SplitGroups(exchange="process-group")
        groups.prepare(splits)
        loss = torch.zeros(())
        chunk = groups.chunk(split)
        if chunk is not None:
            packed = pack_chunk(sample, chunk.pieces)
            loss = model(*_inputs(packed), split=chunk)
            loss.backward()
            # forward + backward: one exchange each way per layer (2 layers)
            uses = {k: chunk.exchange.uses[k] for k in ("forward", "backward")}
            assert uses == {"forward": 2, "backward": 2}, uses
        groups.close()
        if comm is not None:
            comm.close()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[name] = g.numpy()
        return float(whole.detach()), float(total), reference, grads, split["ranks"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("exchange", ["nccl", "odc"])
def test_split_sample_loss_and_gradients_equal_the_whole_sample(exchange):
    # 3 ranks, a 61-token sample that the planner splits (uneven zigzag pieces: 61 = 6 x 10 + 1);
    # fp32 on the CPU, so the only differences are summation orders.
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        whole, split, reference, grads, group = odc.launch(_split_rank, 3, store, 61, exchange)[0]
    assert len(group) >= 2
    assert split == pytest.approx(whole, rel=1e-6)
    for name, expected in reference.items():
        assert np.abs(expected).max() > 0, name  # every parameter takes part
        np.testing.assert_allclose(grads[name], expected, rtol=1e-4, atol=1e-6, err_msg=name)


def test_pack_chunk_keeps_global_positions_and_labels():
    sample = np.arange(10, 20)
    packed = pack_chunk(sample, [(0, 2), (8, 10)])
    assert packed.input_ids.tolist() == [10, 11, 18, 19]
    assert packed.position_ids.tolist() == [0, 1, 8, 9]
    assert packed.labels.tolist() == [11, 12, 19, IGNORE_INDEX]
    with pytest.raises(ValueError, match="bad chunk"):
        pack_chunk(sample, [(5, 11)])


def _train_outliers(tmp_path, *arguments, env=None):
    """`odc.train` on 2 CPU ranks, tiny preset, over lengths whose two minibatches each hold an
    outlier; returns (the results JSON's runs, stdout). `env`: added to the environment."""
    import json
    import os
    import subprocess
    import sys

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, [200, 10, 12, 8, 9, 300, 11, 7])) + "\n")
    output = tmp_path / "results.json"
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(lengths), "--device", "cpu",
        "--ranks", "2", "--preset", "tiny", "--steps", "1", "--samples-per-rank", "2",
        "--split", "auto", "--cost", "1,0.01,0", "--output", str(output), "--timeline", "",
        *arguments,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(output.read_text()), result.stdout


@pytest.mark.long
def test_train_compare_with_split_runs_and_keeps_the_losses(tmp_path):
    """`odc.train --compare --split auto --kv-exchange both` on 2 CPU ranks: the split runs
    really split (both minibatches hold an outlier) and every run trains to the same losses step
    by step, since a split sample gives the whole sample's loss and gradients (under collectives,
    and under ODC with K/V through a gloo subgroup or through odc pulls)."""
    runs, stdout = _train_outliers(tmp_path, "--compare", "--kv-exchange", "both")
    assert [(r["comm"], r["policy"], r["split"], r["kv_exchange"]) for r in runs] == [
        ("collective", "lb-micro", "off", None),
        ("collective", "lb-micro", "auto", "nccl"),
        ("odc", "lb-mini", "auto", "nccl"),
        ("odc", "lb-mini", "auto", "odc"),
    ]
    assert runs[0]["split_samples"] == 0
    assert all(r["split_samples"] == 1 for r in runs[1:])  # the measured minibatch
    assert runs[3]["memory"]["odc_kv_exchange_bytes"] > 0  # the odc buffers were made
    assert "lb-mini+split/odc" in stdout
    for run in runs[1:]:
        assert run["losses"] == pytest.approx(runs[0]["losses"], rel=1e-5)
        # The members' split chunks are their first microbatch (timeline of the last minibatch).
        assert all(len(rank) >= 1 for rank in run["timeline"])


def test_split_runs_at_the_least_staging_budget(tmp_path):
    """design.md's progress rule: with rings of one 256-byte slot per sender (ODC_STAGING_BYTES=720
    at 2 ranks, the least there is), one rank's gradient pushes wait for the other's credit while
    that rank waits in the split's K/V exchange (a gloo subgroup, or odc's sub-communicator);
    the owner's progress thread folds for it. Stalled for the whole timeout before."""
    runs, _ = _train_outliers(tmp_path, "--kv-exchange", "both", env={"ODC_STAGING_BYTES": "720"})
    assert [(r["comm"], r["kv_exchange"]) for r in runs] == [("odc", "nccl"), ("odc", "odc")]
    assert all(r["split_samples"] == 1 for r in runs)


def test_default_kv_exchange_is_odc_for_odc_runs_on_a_flat_mesh(tmp_path):
    """Without --kv-exchange, an ODC run that splits exchanges K/V through odc pulls (measured
    faster on 4 H200s, docs/benchmarks.md), and says so in its JSON."""
    runs, _ = _train_outliers(tmp_path)
    (run,) = runs
    assert (run["comm"], run["split"], run["kv_exchange"]) == ("odc", "auto", "odc")
    assert run["split_samples"] == 1 and run["memory"]["odc_kv_exchange_bytes"] > 0


def test_microbatch_log_and_profile(tmp_path):
    """The results JSON logs every measured microbatch (what it held, its times, its host time),
    split chunks included, and --profile writes a trace and a table per rank without adding the
    profiled minibatch to the results."""
    import gzip
    import json

    runs, _ = _train_outliers(tmp_path, "--profile", str(tmp_path / "profile"))
    (run,) = runs
    (minibatch,) = run["microbatch_log"]  # --steps 1: one measured minibatch
    assert len(minibatch) == 2 and len(run["losses"]) == 2  # warm-up + measured, no profiled
    chunks = [m for rank in minibatch for m in rank if "split" in m]
    assert len(chunks) == 2  # the outlier of 300 tokens, on both ranks
    assert all(c["split"]["length"] == 300 and c["split"]["members"] == 2 for c in chunks)
    assert sum(e - b for c in chunks for b, e in c["split"]["pieces"]) == 300
    for rank, timeline in zip(minibatch, run["timeline"]):
        assert [(m["start"], m["end"], m["tokens"]) for m in rank] == [tuple(t) for t in timeline]
        for m in rank:
            assert m["end"] >= m["start"] and m["host_seconds"] > 0
            if "lengths" in m:
                assert sum(m["lengths"]) == m["tokens"]
    for rank in range(2):
        base = tmp_path / "profile" / f"odc_lb-mini_split_kv-odc_rank{rank}"
        trace = json.loads(gzip.decompress((base.parent / (base.name + ".json.gz")).read_bytes()))
        assert trace["traceEvents"]
        assert "self_cpu_time_total" in (base.parent / (base.name + ".txt")).read_text()


def test_split_chunk_reaches_layers_unchanged_through_fsdp2_mixed_precision():
    """FSDP2 with a mixed-precision policy casts forward inputs, rebuilding any dataclass among
    them; the SplitChunk must arrive in the layer as the very object given (its index tensors
    are cached on it once per chunk, not rebuilt per layer on the host)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from odc.torch.split import SplitChunk

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))
            self.seen = []

        def forward(self, x, odc_split=None):
            self.seen.append(odc_split)
            return x * self.weight

    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group(
            "gloo", init_method=f"file://{directory}/store", rank=0, world_size=1
        )
        try:
            module = Recorder()
            fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
            chunk = SplitChunk(None, 0, [[(0, 2)], [(2, 4)]])
            chunk.gather_index(torch.device("cpu"))  # cached before the forward, as run.py does
            module(torch.ones(2), odc_split=chunk)
            assert module.seen == [chunk] and module.seen[0] is chunk
            assert chunk.gather_index(torch.device("cpu")) is chunk._index_tensor
        finally:
            dist.destroy_process_group()
