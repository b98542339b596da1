"""Do packed rungs in the cost fit help? An offline check on measured microbatches (issue #30).

`odc.train --cost fit` fitted a, b, c on single-sample rungs only; the SFT runs of the fifteenth
round (docs/results/baselines_4xh100/sft_*.json) then came out 4-10% too fast, their packed
microbatches 5-20%. The rungs cannot be re-measured, so this stands in for them: the recorded
single rungs plus packed microbatches logged by ONE arm (the training arm, default ODC + LB-Mini of
the first file) are fitted with calibrate.fit_cost_with_floor, and the fit is evaluated on every
OTHER arm of every file (each file with its own recorded rungs and floor) against (a) the cost
the run used (single rungs only).

What is compared, per arm (a microbatch's measured time is its end - start on its rank):
  odc               every microbatch of every rank (ranks run free between minibatch ends)
  collective,       lockstep: every rank waits at each layer's collectives, so microbatch i
  fsdp2-deferred    takes the slowest rank's time: max over ranks, measured and predicted
  fsdp2-unsharded   every microbatch but each rank's last (that one waits for the others at the
                    final reduce-scatters)

    python dev/analysis/packed_rungs.py [results.json ...] [--train-file F] [--train-comm odc]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
from odc._cost_fit import fit_cost_with_floor, split_evenly  # noqa: E402

DEFAULT_FILES = [
    REPO / "docs/results/baselines_4xh100/sft_1.5b_4xh100.json",
    REPO / "docs/results/baselines_4xh100/sft_1.5b_4xh100_run2.json",
]
LOCKSTEP = ("collective", "fsdp2-deferred")
PACKED_RUNGS = 4  # as many packed points as the ladder has packed rungs (calibrate.packed_ladder)


def predict(cost, lengths: List[int]) -> float:
    a, b, c, floor = cost
    return max(floor, c + sum(a * n + b * n * n for n in lengths))


def points(run: dict) -> List[Tuple[List[int], float]]:
    """(lengths, seconds) of the logged microbatches that ran free of the other ranks: every one
    of an odc arm, all but each rank's last of fsdp2-unsharded (split chunks left out)."""
    if run["comm"] in LOCKSTEP:
        raise SystemExit(f"a {run['comm']} arm's microbatches wait for the slowest rank")
    last = run["comm"] == "fsdp2-unsharded"
    rows = []
    for ranks in run.get("microbatch_log", []):
        for entries in ranks:
            for entry in entries[:-1] if last else entries:
                if "split" not in entry:
                    rows.append((entry["lengths"], entry["end"] - entry["start"]))
    return rows


def comparisons(run: dict, cost) -> List[Tuple[float, float]]:
    """(predicted, measured) pairs for one arm, as the module docstring says."""
    pairs = []
    for ranks in run.get("microbatch_log", []):
        if any("split" in e for entries in ranks for e in entries):
            continue
        if run["comm"] in LOCKSTEP:
            if len({len(entries) for entries in ranks}) != 1:
                continue  # unequal counts: no microbatch-by-microbatch lockstep
            for index in range(len(ranks[0])):
                column = [entries[index] for entries in ranks]
                guess = max(predict(cost, e["lengths"]) for e in column)
                pairs.append((guess, max(e["end"] - e["start"] for e in column)))
            continue
        last = run["comm"] == "fsdp2-unsharded"
        for entries in ranks:
            for entry in entries[:-1] if last else entries:
                pairs.append((predict(cost, entry["lengths"]), entry["end"] - entry["start"]))
    return pairs


def rungs_of(runs: List[dict]):
    """The recorded rungs as document lengths and seconds ([tokens, seconds] for one sample,
    [tokens, seconds, documents] for a packed rung: that many documents of tokens / documents),
    and the floor (the first rung's seconds)."""
    calibration = next(r["calibration"] for r in runs if r.get("calibration"))
    floor = calibration[0][1]
    lengths = [split_evenly(int(rung[0]), int(rung[2]) if len(rung) > 2 else 1)
               for rung in calibration[1:]]  # fmt: skip
    return lengths, [rung[1] for rung in calibration[1:]], floor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="*", default=[str(p) for p in DEFAULT_FILES])
    parser.add_argument("--train-file", type=int, default=0, help="index of the training file")
    parser.add_argument(
        "--train-comm", default="odc", help="the training arm's comm (odc or fsdp2-unsharded)"
    )
    args = parser.parse_args(argv)
    files = [(Path(p).name, json.loads(Path(p).read_text())) for p in args.results]
    train_name, train_runs = files[args.train_file]
    train_run = next(r for r in train_runs if r["comm"] == args.train_comm)
    packed = [(lengths, s) for lengths, s in points(train_run) if len(lengths) > 1]
    longest = sorted(packed, key=lambda p: -sum(p[0]))[:PACKED_RUNGS]
    print(
        f"training arm: {train_name} {train_run['comm']} + {train_run['policy']}: "
        f"{len(packed)} packed microbatches (the {PACKED_RUNGS} longest: "
        + ", ".join(f"{sum(p[0])} tok/{len(p[0])} docs" for p in longest)
        + ")"
    )
    variants = ("recorded", f"+{PACKED_RUNGS} packed", "+all packed")
    totals = {v: [] for v in variants}
    header = f"{'file':28} {'arm':34} {'n':>3}" + "".join(f" {v:>20}" for v in variants)
    print("errors: mean signed / mean absolute of (predicted - measured) / measured")
    print(header)
    for name, runs in files:
        lengths, seconds, floor = rungs_of(runs)
        costs = {"recorded": tuple(runs[0]["cost"])}
        for label, extra in ((variants[1], longest), (variants[2], packed)):
            costs[label] = fit_cost_with_floor(
                lengths + [p[0] for p in extra], seconds + [p[1] for p in extra], floor
            )
        for label, cost in costs.items():
            print(f"  {label:12} a={cost[0]:.4g} b={cost[1]:.4g} c={cost[2]:.4g} f={cost[3]:.4g}")
        for run in runs:
            held_out = not (name == train_name and run is train_run)
            arm = f"{run['comm']} + {run['policy']}" + ("" if held_out else " (train)")
            cells, count = [], 0
            for label, cost in costs.items():
                pairs = comparisons(run, cost)
                errors = [(g - m) / m for g, m in pairs]
                count = len(errors)
                if held_out:
                    totals[label] += errors
                cells.append(f"{np.mean(errors):+7.1%} / {np.mean(np.abs(errors)):5.1%}")
            print(f"{name:28} {arm:34} {count:3d}" + "".join(f" {c:>20}" for c in cells))
    print(
        f"{'held-out arms, all':63} {len(totals[variants[0]]):3d}"
        + "".join(f" {np.mean(e):+7.1%} / {np.mean(np.abs(e)):5.1%}" for e in totals.values())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
