#!/usr/bin/env python3
"""Predicted bubbles of `odc plan` on the shipped data files, for two builds side by side.

Usage: plan_quality.py OLD_ODC NEW_ODC [--quick]
Plans every data/*.txt file with every policy, several rank counts, minibatch sizes and both cost
models (linear tokens; the H200 fit of docs/design.md, "Measuring"), and prints one row per case
with both builds' bubbles and microbatch counts, plus how many cases got better, worse or stayed
equal.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COSTS = {"linear": "1,0,0", "h200": "1.69e-5,9.75e-10,0.069"}


def plan(odc: str, lengths: Path, policy: str, ranks: int, minibatch, cost: str, cap: int):
    command = [odc, "plan", "--lengths", str(lengths), "--policy", policy, "--ranks", str(ranks)]
    command += ["--max-tokens", str(cap), "--cost", cost]
    if minibatch:
        command += ["--minibatch-size", str(minibatch)]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    seconds = time.perf_counter() - start
    result = json.loads(out)
    microbatches = sum(
        len(rank["microbatches"]) for mb in result["minibatches"] for rank in mb["ranks"]
    )
    return result["bubble"]["collective"], result["bubble"]["odc"], microbatches, seconds


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv
    better = worse = equal = 0
    print(
        f"{'file':16} {'policy':10} {'N':>3} {'mb':>5} {'cost':6} "
        f"{'coll old':>9} {'coll new':>9} {'odc old':>8} {'odc new':>8} "
        f"{'#mb old':>8} {'#mb new':>8} {'s old':>6} {'s new':>6}"
    )
    for lengths in sorted((ROOT / "data").glob("*.txt")):
        for cost_name, cost in COSTS.items():
            for ranks in (2, 4, 8, 16, 64):
                for minibatch in (None, 512, 64):
                    if quick and (ranks not in (4, 64) or minibatch == 64):
                        continue
                    for policy in ("local-sort", "lb-micro", "lb-mini"):
                        a = plan(old, lengths, policy, ranks, minibatch, cost, 65536)
                        b = plan(new, lengths, policy, ranks, minibatch, cost, 65536)
                        # LB-Mini runs under ODC only; the others are judged by both bubbles.
                        keys = [1] if policy == "lb-mini" else [0, 1]
                        delta = [b[k] - a[k] for k in keys] + [b[2] - a[2]]
                        if all(abs(d) < 1e-12 for d in delta):
                            equal += 1
                        elif all(d <= 1e-12 for d in delta):
                            better += 1
                        else:
                            worse += 1
                        print(
                            f"{lengths.stem[:16]:16} {policy:10} {ranks:3} "
                            f"{minibatch or 'all':>5} {cost_name:6} "
                            f"{a[0]:9.4%} {b[0]:9.4%} {a[1]:8.4%} {b[1]:8.4%} "
                            f"{a[2]:8d} {b[2]:8d} {a[3]:6.2f} {b[3]:6.2f}",
                            flush=True,
                        )
    print(f"cases: {equal} equal, {better} better, {worse} worse (new vs old)")


if __name__ == "__main__":
    main()
