"""odc.plan(split="auto") and `odc plan/compare --split auto`: the same plans, split
samples listed under "splits" with chunks covering every token once, and named errors."""

import json
import subprocess

import pytest

import odc

# Two outliers among short samples: each costs more than a rank's share of its minibatch.
LENGTHS = [900, 20, 30, 25, 15, 10, 35, 40, 700, 5, 12, 18]
COST = "1,0.01,0.5"


def run_cli(odc_cli, *args):
    return subprocess.run([odc_cli, *args], capture_output=True, text=True, timeout=120)


def _plan(policy, split="auto", **kwargs):
    return odc.plan(
        LENGTHS,
        ranks=4,
        max_tokens=900,
        policy=policy,
        samples_per_rank=2,
        cost=(1, 0.01, 0.5),
        split=split,
        **kwargs,
    )


@pytest.mark.parametrize("policy", ["lb-mini", "lb-micro"])
def test_split_plan_runs_every_token_once(policy):
    plan = _plan(policy)
    assert plan["split"] == {"mode": "auto", "exchange": 0.05}
    split_samples = []
    for minibatch in plan["minibatches"]:
        in_microbatches = [s for r in minibatch["ranks"] for m in r["microbatches"] for s in m]
        grouped = []
        for split in minibatch["splits"]:
            split_samples.append(split["sample"])
            grouped += split["ranks"]
            tokens = sorted(t for chunk in split["chunks"] for b, e in chunk for t in range(b, e))
            assert tokens == list(range(LENGTHS[split["sample"]]))
            assert len(split["chunk_costs"]) == len(split["ranks"]) >= 2
        assert len(grouped) == len(set(grouped)), "groups must be disjoint"
        splits = [s["sample"] for s in minibatch["splits"]]
        assert sorted(in_microbatches + splits) == minibatch["samples"]
    assert split_samples == [0, 8]  # both outliers, and nothing else
    whole = _plan(policy, split="off")
    mode = "odc" if policy == "lb-mini" else "collective"
    assert plan["bubble"][mode] < whole["bubble"][mode]


def test_split_off_keeps_the_original_document():
    plan = _plan("lb-mini", split="off")
    assert "split" not in plan
    assert all("splits" not in m for m in plan["minibatches"])


def test_python_equals_cli_with_split(odc_cli, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    common = ["--lengths", str(path), "--ranks", "4", "--max-tokens", "900", "--cost", COST]
    common += ["--samples-per-rank", "2", "--split", "auto"]
    result = run_cli(odc_cli, "plan", *common, "--policy", "lb-mini", "--split-exchange", "0.2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == _plan("lb-mini", split_exchange=0.2)
    table = run_cli(odc_cli, "compare", *common)
    assert table.returncode == 0, table.stderr
    lines = [line for line in table.stdout.splitlines()[1:] if line.strip()]
    rows = {line.split()[0]: line for line in lines if not line.startswith(("decision:", "why:"))}
    # Splitting the two outliers is the whole win here: FSDP2 with split is as fast as ODC.
    assert "decision: use FSDP2 (collective + lb-micro+split) at 4 GPUs: " in table.stdout
    assert set(rows) == {"local-sort", "lb-micro", "lb-mini", "lb-micro+split", "lb-mini+split"}
    assert rows["lb-mini+split"].split()[-1] == "2"  # split samples
    assert rows["lb-mini"].split()[-1] == "-"


def test_split_errors_are_named(odc_cli, tmp_path):
    with pytest.raises(ValueError, match="unknown split mode 'on': expected auto or off"):
        _plan("lb-mini", split="on")
    with pytest.raises(ValueError, match="split auto needs policy lb-mini or lb-micro"):
        _plan("local-sort")
    with pytest.raises(ValueError, match="split_exchange must be a non-negative number"):
        _plan("lb-mini", split_exchange=-0.5)
    path = tmp_path / "lengths.txt"
    path.write_text("10\n")
    result = run_cli(
        odc_cli, "plan", "--lengths", str(path), "--ranks", "2", "--max-tokens", "10",
        "--policy", "lb-mini", "--split", "sometimes",
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown split mode 'sometimes': expected auto or off" in result.stderr


def test_train_prediction_counts_split_chunks_like_the_planner():
    """odc.train's per-minibatch prediction (metrics.predict_minibatch) gives, with the plan's
    "splits", exactly the planner's own per-minibatch bubbles, under both modes; without them a
    split minibatch would look nearly free (its outlier is in no rank's microbatches)."""
    from odc.train.metrics import predict_minibatch

    lengths = [60000, 900, 1200, 800, 2500, 700, 3000, 1100] * 2
    cost = (3.123e-05, 1.187e-09, 0.07082)
    for policy, mode in [("lb-mini", "odc"), ("lb-micro", "collective"), ("lb-micro", "odc")]:
        plan = odc.plan(
            lengths, ranks=4, max_tokens=65536, policy=policy, cost=cost, split="auto",
            samples_per_rank=2,
        )  # fmt: skip
        assert all(m["splits"] for m in plan["minibatches"]), policy
        for minibatch in plan["minibatches"]:
            with_splits = predict_minibatch(
                minibatch["ranks"], lengths, cost, mode, minibatch["splits"]
            )
            busy = sum(with_splits.busy_seconds)
            bubble = 1 - busy / (4 * with_splits.span_seconds)
            assert bubble == pytest.approx(minibatch["bubble"][mode], abs=1e-9), (policy, mode)
            without = predict_minibatch(minibatch["ranks"], lengths, cost, mode)
            assert without.span_seconds < with_splits.span_seconds


def _floored_span(minibatch, lengths, cost, mode):
    """The minibatch's predicted span under `cost` (with its floor), chunks costed with it too."""
    from odc.train.metrics import predict_minibatch

    splits = [
        {**s, "chunk_costs": [max(cost[3], c) for c in s["chunk_costs"]]}
        for s in minibatch.get("splits", [])
    ]
    return predict_minibatch(minibatch["ranks"], lengths, cost, mode, splits).span_seconds


def test_planning_with_a_floor_is_never_slower_than_ignoring_it():
    """Random minibatches (2-8 ranks, outliers up to 64K, floors 0.1-1 s, both policies, split
    on and off): the plan made knowing the floor is never predicted slower, under the floor
    model, than the plan made without it; every sample runs once and within the token cap."""
    import random

    rng = random.Random(2)
    for _ in range(300):
        ranks = rng.choice([2, 3, 4, 8])
        lengths = [
            rng.randint(2, 64000) if rng.random() < 0.15 else rng.randint(2, 4000)
            for _ in range(rng.randint(ranks, 32))
        ]
        floor = rng.choice([0.1, 0.3, 1.0])
        cost = (3e-5, 1.2e-9, 0.07, floor)
        options = dict(
            ranks=ranks,
            max_tokens=max(lengths) + rng.choice([0, 1000, 65536]),
            policy=rng.choice(["lb-mini", "lb-micro"]),
            split=rng.choice(["off", "auto"]),
            microbatch_memory=rng.choice(["lb-micro", "cap"]),
            samples_per_rank=None,
        )
        mode = "odc" if options["policy"] == "lb-mini" else "collective"
        (aware,) = odc.plan(lengths, cost=cost, **options)["minibatches"]
        (blind,) = odc.plan(lengths, cost=cost[:3], **options)["minibatches"]
        assert _floored_span(aware, lengths, cost, mode) <= _floored_span(
            blind, lengths, cost, mode
        ) * (1 + 1e-9), (options, floor, lengths)
        ran = sorted(i for r in aware["ranks"] for m in r["microbatches"] for i in m)
        assert ran == sorted(
            set(range(len(lengths))) - {s["sample"] for s in aware.get("splits", [])}
        )
        for r in aware["ranks"]:
            for m in r["microbatches"]:
                assert sum(lengths[i] for i in m) <= options["max_tokens"]


def test_a_floor_does_not_pile_short_samples_onto_one_rank():
    """Below the floor every rank takes the same time: ties go to the lighter rank, so 30 short
    samples around a 2-member split spread over the two free ranks (before: 29 on one, past the
    token cap, and the split was dropped)."""
    lengths = [40000] + [2000] * 30
    plan = odc.plan(
        lengths, ranks=4, max_tokens=40000, policy="lb-mini", split="auto",
        cost=(3e-5, 1.2e-9, 0.07, 2.0), samples_per_rank=None,
    )  # fmt: skip
    (minibatch,) = plan["minibatches"]
    assert [s["ranks"] for s in minibatch["splits"]] == [[0, 1]]
    counts = [sum(len(m) for m in r["microbatches"]) for r in minibatch["ranks"]]
    assert counts == [0, 0, 15, 15]
    assert _floored_span(minibatch, lengths, (3e-5, 1.2e-9, 0.07, 2.0), "odc") == pytest.approx(2.0)
