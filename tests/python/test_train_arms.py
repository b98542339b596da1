"""The baseline arms of odc.train (odc.train.arms): on the tiny test LM over gloo (3 ranks),
fsdp2-unsharded runs different microbatch counts per rank (one rank none at all) with no collective
between the minibatch's all-gathers and its last backward's reduce-scatters, and trains the
single-process reference's weights; `python -m odc.train --baselines` (2 ranks, tiny preset) runs
all five arms with equal losses, each doing what it is designed to; the plan transforms (padding)
are checked without ranks."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.train arms need torch")

from tiny_lm import LR, MAX_NORM, STEPS, loss_sum, make_model, minibatch_samples  # noqa: E402
from tiny_lm import reference_state  # noqa: E402

from odc.train.arms import adapt_plan  # noqa: E402

# Per rank, its microbatches of each minibatch's 8 samples (sample indices).
UNEQUAL = [[], [[0, 1, 2]], [[3], [4, 5], [6, 7]]]  # 0, 1 and 3 microbatches
EQUAL = [[[0], [1, 2]], [[3, 4], [5]], [[6], [7]]]


def _plan(ranks):
    return {"policy": "lb-mini", "minibatches": [{"ranks": [{"microbatches": m} for m in ranks]}]}


def test_adapt_plan_pads_as_each_arm_needs():
    plan = _plan(UNEQUAL)
    padded = adapt_plan(plan, "collective", "lb-mini-padded")
    assert [r["microbatches"] for r in padded["minibatches"][0]["ranks"]] == [
        [[], [], []],
        [[0, 1, 2], [], []],
        [[3], [4, 5], [6, 7]],
    ]
    assert padded["policy"] == "lb-mini-padded"
    unsharded = adapt_plan(plan, "fsdp2-unsharded", "lb-mini")
    assert [len(r["microbatches"]) for r in unsharded["minibatches"][0]["ranks"]] == [1, 1, 3]
    assert plan == _plan(UNEQUAL)  # the planner's plan is left alone
    assert adapt_plan(plan, "fsdp2-deferred", "lb-micro") is plan


def _arm_rank(rank, world_size, key, store_path, comm, schedule):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc.torch
    from odc.train.arms import CollectiveCounter, GradientSync

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        model = make_model()
        reshard = comm != "fsdp2-unsharded"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model)
        odc.torch.sum_gradients(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        sync, counter = GradientSync(model, comm), CollectiveCounter(model)
        mine = adapt_plan(_plan(schedule), comm, "lb-mini")["minibatches"][0]["ranks"][rank]
        trace = []  # per step: counts after begin, then after each microbatch
        for step in range(STEPS):
            samples = minibatch_samples(step)
            tokens = sum(int(t.shape[1]) - 1 for t in samples)
            sync.begin()
            counts = [counter.take()]
            for index, microbatch in enumerate(mine["microbatches"]):
                sync.before_microbatch(index == len(mine["microbatches"]) - 1)
                if not microbatch:  # an empty microbatch: joins the collectives, adds nothing
                    (loss_sum(model, [samples[0][:, :2]]) * 0).backward()
                else:
                    picked = [samples[i] for i in microbatch]
                    odc.torch.scale_loss(loss_sum(model, picked), tokens).backward()
                counts.append(counter.take())
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            trace.append(counts)
        state = {k: v.full_tensor().float().numpy().copy() for k, v in model.state_dict().items()}
        return trace, state
    finally:
        dist.destroy_process_group()


# fsdp2-deferred (EQUAL counts) passes here too; the CLI test below checks its counts on the real
# model, so CI runs only the arm whose unequal counts, and idle rank, need this harness.
@pytest.mark.parametrize("comm, schedule", [("fsdp2-unsharded", UNEQUAL)])
def test_fsdp2_arm_collectives_and_weights(comm, schedule):
    import odc

    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        results = odc.launch(_arm_rank, 3, store, comm, schedule, timeout=300)
    units = 3  # two blocks and the root
    for rank, (trace, _) in enumerate(results):
        for counts in trace:
            *middle, last = counts[1:]
            if comm == "fsdp2-unsharded":
                # Every unit all-gathers once, at begin; nothing until the last backward, which
                # reduce-scatters every unit once: the same on every rank, whatever its count.
                assert counts[0] == {"all_gather": units, "reduce_scatter": 0}, (rank, counts)
                assert all(c == {"all_gather": 0, "reduce_scatter": 0} for c in middle), counts
                assert last == {"all_gather": 0, "reduce_scatter": units}, (rank, counts)
            else:
                # Every microbatch all-gathers; only the last reduce-scatters (once per unit).
                assert all(c["reduce_scatter"] == 0 and c["all_gather"] > 0 for c in middle)
                assert last["reduce_scatter"] == units and last["all_gather"] > 0, counts
    reference = reference_state()
    for _, state in results:
        for name, expected in reference.items():
            np.testing.assert_allclose(state[name], expected, rtol=2e-4, atol=2e-5, err_msg=name)


def _baselines_lengths(path: Path) -> None:
    """Two minibatches of 10 samples for 2 ranks: under a quadratic cost one 240-token sample
    weighs as much as nine of 80, so LB-Mini gives one rank 1 microbatch and the other 3 (at
    most 240 tokens each, LB-Micro's largest); LB-Micro gives both 3."""
    path.write_text("\n".join(map(str, ([240] + [80] * 9) * 2)) + "\n")


@pytest.mark.long
def test_baselines_run_every_arm_as_designed(tmp_path):
    pytest.importorskip("transformers", reason="odc train needs transformers")
    lengths, output = tmp_path / "lengths.txt", tmp_path / "results.json"
    _baselines_lengths(lengths)
    command = [
        sys.executable, "-m", "odc.train", "--lengths", str(lengths), "--device", "cpu",
        "--ranks", "2", "--preset", "tiny", "--steps", "1", "--samples-per-rank", "5",
        "--cost", "0,0.000001,0", "--baselines", "--output", str(output), "--timeline", "",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {(r["comm"], r["policy"]): r for r in json.loads(output.read_text())}
    assert list(runs) == [
        ("collective", "lb-micro"),
        ("fsdp2-deferred", "lb-micro"),
        ("fsdp2-unsharded", "lb-mini"),
        ("collective", "lb-mini-padded"),
        ("odc", "lb-mini"),
    ]
    # The same summed gradients in every arm: the same losses, and the table says so.
    first = runs["collective", "lb-micro"]["losses"]
    for run in runs.values():
        assert run["losses"] == pytest.approx(first, rel=1e-4)
    assert "losses: AGREE across the 5 runs" in result.stdout

    def counts(run):  # [rank] -> microbatches, and [rank] -> FSDP2 collectives (one minibatch)
        (log,), (collectives,) = run["microbatch_log"], run["fsdp2_collectives"]
        return [len(mbs) for mbs in log], collectives

    plain_counts, plain = counts(runs["collective", "lb-micro"])
    deferred_counts, deferred = counts(runs["fsdp2-deferred", "lb-micro"])
    units = deferred[0]["reduce_scatter"]  # FSDP2 units: the tiny preset's layers and the root
    assert units >= 2 and deferred_counts == plain_counts and plain_counts[0] >= 2
    for rank in range(2):
        # Plain FSDP2 reduce-scatters every unit in every microbatch; deferred once per minibatch,
        # with the same per-microbatch all-gathers.
        assert plain[rank]["reduce_scatter"] == units * plain_counts[rank]
        assert deferred[rank] == {"all_gather": plain[rank]["all_gather"], "reduce_scatter": units}
    # Unsharded: unequal counts, one all-gather and one reduce-scatter per unit per minibatch.
    unsharded_counts, unsharded = counts(runs["fsdp2-unsharded", "lb-mini"])
    assert sorted(unsharded_counts) == [1, 3]
    assert unsharded == [{"all_gather": units, "reduce_scatter": units}] * 2
    # Padded: LB-Mini's plan (ODC ran it unpadded) padded with empty microbatches to equal counts.
    padded_counts, padded = counts(runs["collective", "lb-mini-padded"])
    odc_counts, odc_collectives = counts(runs["odc", "lb-mini"])
    assert sorted(odc_counts) == [1, 3] and odc_collectives == [None, None]
    assert padded_counts == [3, 3]
    (log,) = runs["collective", "lb-mini-padded"]["microbatch_log"]
    assert sum(1 for mbs in log for mb in mbs if mb["lengths"] == []) == 2
    assert all(p["reduce_scatter"] == units * 3 for p in padded)
