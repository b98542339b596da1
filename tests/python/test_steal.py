"""Work stealing predicted (docs/planner.md, "Work stealing"): odc.steal_span and
odc.steal_minibatch against hand-computed schedules and the planner's own prediction,
odc.plan(steal=True), and the `odc plan --steal` / `odc simulate --steal --rank-slowdown` flags."""

import heapq
import json
import random
import subprocess

import pytest

import odc

LENGTHS = [40, 300, 120, 500, 75, 210, 64, 480, 33, 90, 256, 12, 700, 18, 150, 95]


def run_cli(odc_cli, *args):
    return subprocess.run([odc_cli, *args], capture_output=True, text=True, timeout=120)


def test_slow_rank_hand_computed():
    # Three queues of six unit items, rank 2 1.3x slower: rank 0 takes queue 2's last item at 6.
    result = odc.steal_span([[1.0] * 6] * 3, rank_speed=[1, 1, 1 / 1.3])
    assert result.span == pytest.approx(7.0)
    assert result.moved == 1
    assert result.runner[2] == [2, 2, 2, 2, 2, 0]
    assert result.finish == pytest.approx([7.0, 6.0, 6.5])
    assert result.bubble == pytest.approx(1 - 19.5 / 21)


def test_counts_ties_actual_and_starts():
    # Counts alone: unit costs. Queue 0 holds everything: at 0 its owner takes the front, rank 1
    # the tail, rank 2 the next tail; at 1 the owner takes the last one.
    assert odc.steal_span([4, 0, 0]).runner == [[0, 0, 2, 1], [], []]
    # Equal predicted sums: the lowest rank is robbed; actual costs set durations only.
    result = odc.steal_span([[], [3, 1], [2, 2]], actual=[[], [3, 1], [20, 2]])
    assert result.runner == [[], [1, 0], [2, 0]]
    assert result.span == 20.0
    # Rank 1 busy until 5 (its split chunk): rank 0 runs all three items.
    result = odc.steal_span([[1], [2, 3]], rank_start=[0, 5])
    assert result.runner == [[0], [0, 0]] and result.span == 6.0 and result.busy == [6.0, 0.0]
    assert odc.steal_span([]).span == 0.0


def reference_steal(queues, actual, speed, start):
    """The rule written as plainly as possible: every theft adds up every queue's unclaimed costs
    from its front, as the work board does (O(items x ranks) per theft)."""
    ranks = len(queues)
    front, back = [0] * ranks, [len(q) for q in queues]
    runner = [[None] * len(q) for q in queues]
    free = [(start[r], r) for r in range(ranks)]
    heapq.heapify(free)
    finish = list(start)
    while free:
        now, rank = heapq.heappop(free)
        if front[rank] < back[rank]:
            queue, item = rank, front[rank]
            front[rank] += 1
        else:
            best = None
            for q in range(ranks):
                if front[q] < back[q]:
                    left = 0.0
                    for i in range(front[q], back[q]):
                        left += queues[q][i]
                    if best is None or left > best[0]:
                        best = (left, q)
            if best is None:
                continue
            queue = best[1]
            back[queue] -= 1
            item = back[queue]
        runner[queue][item] = rank
        finish[rank] = now + actual[queue][item] / speed[rank]
        heapq.heappush(free, (finish[rank], rank))
    return runner, max(finish, default=0.0)


# Decimals whose sums round differently depending on where the adding starts (0.4 + 2.5 + 2.3 -
# 0.4 != 2.5 + 2.3 == 4.8), so ties decided by rounding occur.
COSTS = [0.1, 0.2, 0.3, 0.4, 0.7, 1.0, 2.3, 2.5, 4.8]


def test_matches_a_plain_reference_on_random_queues():
    # Costs that meet rounding and ties, actual ones apart, unequal speeds and starts: the library
    # and the plain rule agree on who ran what, item by item.
    rng = random.Random(45)
    for _ in range(1000):
        ranks = rng.randint(1, 6)
        queues = [[rng.choice(COSTS) for _ in range(rng.randint(0, 6))] for _ in range(ranks)]
        actual = [[c * rng.choice([0.5, 1.0, 2.0]) for c in q] for q in queues]
        speed = [rng.choice([0.5, 1.0, 1 / 1.3]) for _ in range(ranks)]
        start = [rng.choice([0.0, 0.0, 0.7]) for _ in range(ranks)]
        result = odc.steal_span(queues, actual=actual, rank_speed=speed, rank_start=start)
        runner, span = reference_steal(queues, actual, speed, start)
        assert result.runner == runner, (queues, actual, speed, start)
        assert result.span == pytest.approx(span)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"queues": [[1.0], [-1.0]]}, "predicted cost of queue 1's item 0 is -1: expected"),
        ({"queues": [[1.0], [1.0]], "actual": [[1.0]]}, "actual must have one list per rank"),
        ({"queues": [[1.0], [1.0]], "actual": [[1.0], []]}, "actual[1] must hold one cost"),
        ({"queues": [[1.0], [1.0]], "rank_speed": [1.0]}, "rank_speed must have one entry"),
        ({"queues": [[1.0], [1.0]], "rank_speed": [1.0, 0.0]}, "speed of rank 1 is 0"),
        ({"queues": [[1.0], "x"]}, "queues[1] must be a count or a list"),
        ({"queues": [2, -1]}, "queue 1 has a negative count -1"),
    ],
)
def test_errors_name_the_input(kwargs, message):
    with pytest.raises(odc.InvalidArgument, match=message.replace("[", r"\[")):
        odc.steal_span(**kwargs)


@pytest.mark.parametrize("split", ["off", "auto"])
def test_plan_with_steal_matches_steal_minibatch(split):
    # The planner's per-minibatch prediction and the Python helper on the same plan agree: the
    # round trip the training loop makes (plan -> per-rank microbatch costs -> steal_span).
    cost = (1.0, 0.002, 30.0, 60.0)
    plan = odc.plan(
        LENGTHS, ranks=4, max_tokens=700, policy="lb-mini", minibatch_size=8, cost=cost,
        split=split, steal=True,
    )  # fmt: skip
    total_time = total_odc = 0.0
    for minibatch in plan["minibatches"]:
        steal = minibatch["steal"]
        result = odc.steal_minibatch(minibatch, LENGTHS, cost)
        assert result.span == pytest.approx(steal["time"], rel=1e-12)
        assert result.moved == steal["moved"]
        assert steal["time"] <= steal["odc_time"] * (1 + 1e-12)  # equal speeds: never longer
        total_time += steal["time"]
        total_odc += steal["odc_time"]
    assert plan["steal"]["time"] == pytest.approx(total_time)
    assert plan["steal"]["odc_time"] == pytest.approx(total_odc)
    without = odc.plan(LENGTHS, ranks=4, max_tokens=700, policy="lb-mini", minibatch_size=8,
                       cost=cost, split=split)  # fmt: skip
    assert "steal" not in without and without["minibatches"] == [
        {k: v for k, v in m.items() if k != "steal"} for m in plan["minibatches"]
    ]
    with pytest.raises(odc.InvalidArgument, match="steal must be True or False"):
        odc.plan(LENGTHS, ranks=4, max_tokens=700, policy="lb-mini", steal="yes")


def test_cli_plan_steal(odc_cli, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    args = ["plan", "--lengths", str(path), "--ranks", "4", "--policy", "lb-mini", "--steal"]
    result = run_cli(odc_cli, *args)
    assert result.returncode == 0, result.stderr
    from_cli = json.loads(result.stdout)
    assert from_cli == odc.plan(LENGTHS, ranks=4, max_tokens=700, policy="lb-mini",
                                minibatch_size=16, steal=True)  # fmt: skip
    table = run_cli(odc_cli, *args, "--format", "table")
    assert "odc + stealing" in table.stdout


def test_cli_simulate_steal_and_rank_slowdown(odc_cli, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS * 4)) + "\n")
    base = ["simulate", "--lengths", str(path), "--model", "tiny", "--cost", "1e-4,1e-7,1e-3"]
    base += ["--minibatches", "2", "--policies", "lb-micro,lb-mini"]
    result = run_cli(odc_cli, *base, "--ranks", "4", "--rank-slowdown", "9:1.3")
    assert result.returncode == 2
    assert "--rank-slowdown 9:1.3: rank 9 does not exist with --ranks 4 (ranks 0 to 3)" in (
        result.stderr
    )
    result = run_cli(odc_cli, *base, "--ranks", "4", "--rank-slowdown", "2=1.3")
    assert result.returncode == 2 and "expected RANK:FACTOR" in result.stderr
    args = [*base, "--ranks", "4,8", "--steal", "--rank-slowdown", "1:2", "--format", "json"]
    result = run_cli(odc_cli, *args, "--rank-slowdown", "3:1.5")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["steal"] is True
    assert document["rank_slowdown"] == [{"rank": 1, "factor": 2.0}, {"rank": 3, "factor": 1.5}]
    steal_rows = [row for row in document["results"] if row["policy"].endswith("+steal")]
    assert {row["mode"] for row in steal_rows} == {"odc", "odc-hybrid"}
    assert {row["policy"] for row in steal_rows} == {"lb-micro+steal", "lb-mini+steal"}


def test_odc_train_predicts_a_stealing_run_with_the_planner_model():
    """odc.train's prediction of an ODC run with --steal: the planner's model of the claims
    (odc.steal_minibatch), the split chunk counted in its member's busy time."""
    from odc.train.arms import prediction_mode
    from odc.train.metrics import predict_minibatch

    lengths = [10, 10, 10, 10, 40, 6]
    ranks = [{"microbatches": [[0], [1], [2], [3]]}, {"microbatches": [[5]]}]
    splits = [{"sample": 4, "ranks": [1], "chunks": 1, "chunk_costs": [40.0]}]
    cost = (1.0, 0.0, 0.0)
    assert prediction_mode("odc", steal=True) == "odc-steal"
    assert prediction_mode("collective", steal=True) == "collective"
    plain = predict_minibatch(ranks, lengths, cost, "odc", splits)
    stealing = predict_minibatch(ranks, lengths, cost, "odc-steal", splits)
    model = odc.steal_minibatch({"ranks": ranks, "splits": splits}, lengths, cost)
    assert plain.span_seconds == 46.0  # rank 1: its chunk, then sample 5
    # Rank 1 is free at 40, after its chunk, as rank 0 is after its four samples: rank 0 goes
    # first (rank order) and takes sample 5, the tail of rank 1's queue (open from the start).
    assert stealing.span_seconds == model.span == 46.0
    assert stealing.busy_seconds == [46.0, 40.0]
    no_split = [{"microbatches": [[0], [1], [2], [3]]}, {"microbatches": []}]
    moved = predict_minibatch(no_split, lengths, cost, "odc-steal")
    assert moved.span_seconds == 20.0 and moved.busy_seconds == [20.0, 20.0]
