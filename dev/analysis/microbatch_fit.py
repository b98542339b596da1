"""Measured microbatches against the planner's cost model, from `odc.train` results JSON.

For every run in the file: each measured microbatch's GPU seconds (end - start), its host
seconds (enqueue time of forward + backward) and the planner's predicted cost (packed:
c + sum(a L + b L^2); split chunk: the planner's split_chunk_cost). Prints the error by kind and
token range, and a least-squares fit of what ran (a, b, c) on packed microbatches, so the gap
between the calibration fit and the run's own microbatches can be seen.

    python dev/analysis/microbatch_fit.py results.json [--exchange 0.05]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from odc._cost_fit import fit_cost  # noqa: E402
from odc.train.metrics import cost_terms, describe_cost  # noqa: E402


def causal_pairs(begin: float, end: float) -> float:
    return (end * (end + 1.0) - begin * (begin + 1.0)) / 2.0


def predicted(entry: dict, cost, exchange: float) -> float:
    a, b, c, floor = cost_terms(cost)
    if "split" in entry:
        split = entry["split"]
        total = float(split["length"])
        tokens = sum(e - s for s, e in split["pieces"])
        pairs = sum(causal_pairs(s, e) for s, e in split["pieces"])
        attention = b * total * total * pairs / causal_pairs(0, total)
        return max(floor, c + a * tokens + attention + exchange * a * (total - tokens))
    return max(floor, c + sum(a * n + b * n * n for n in entry["lengths"]))


def describe(run: dict, exchange: float) -> None:
    cost = run["cost"]
    label = f"{run['comm']} + {run['policy']}" + (" + split" if run.get("split") == "auto" else "")
    if run.get("kv_exchange"):
        label += f" (K/V {run['kv_exchange']})"
    print(f"\n== {label}: cost {describe_cost(cost)}")
    rows = []
    for minibatch, ranks in enumerate(run.get("microbatch_log", [])):
        for rank, entries in enumerate(ranks):
            for index, entry in enumerate(entries):
                seconds = entry["end"] - entry["start"]
                rows.append(
                    (
                        minibatch,
                        rank,
                        index,
                        "chunk" if "split" in entry else "packed",
                        entry["tokens"],
                        seconds,
                        predicted(entry, cost, exchange),
                        entry["host_seconds"],
                        entry,
                    )
                )
    if not rows:
        print("no microbatch_log in this run")
        return
    print("mb rank idx kind    tokens  measured predicted  error  host  host/gpu")
    for mb, rank, index, kind, tokens, seconds, guess, host, _ in rows:
        print(
            f"{mb:2d} {rank:4d} {index:3d} {kind:6s} {tokens:7d} {seconds:9.3f} {guess:9.3f}"
            f" {(guess - seconds) / seconds:+6.1%} {host:6.3f} {host / seconds:6.2f}"
        )
    print("\nkind / tokens       count  mean error  mean measured  mean host/gpu")
    bins = [(0, 2048), (2048, 8192), (8192, 32768), (32768, 1 << 40)]
    for kind in ("packed", "chunk"):
        for low, high in bins:
            chosen = [r for r in rows if r[3] == kind and low <= r[4] < high]
            if not chosen:
                continue
            errors = [(r[6] - r[5]) / r[5] for r in chosen]
            print(
                f"{kind:6s} [{low:6d},{high if high < 1 << 40 else 'inf'!s:>6s})"
                f" {len(chosen):5d} {np.mean(errors):+10.1%} {np.mean([r[5] for r in chosen]):13.3f}"
                f" {np.mean([r[7] / r[5] for r in chosen]):13.2f}"
            )
    packed = [r for r in rows if r[3] == "packed"]
    if len(packed) >= 3:
        # One row per microbatch: L = tokens, L^2 -> sum of squares (fit on the same basis).
        tokens = np.array([r[4] for r in packed], dtype=float)
        squares = np.array([sum(n * n for n in r[8]["lengths"]) for r in packed], dtype=float)
        seconds = np.array([r[5] for r in packed])
        design = np.stack([tokens, squares, np.ones_like(tokens)], axis=1)
        solution, *_ = np.linalg.lstsq(design, seconds, rcond=None)
        print(
            f"\nleast squares on this run's packed microbatches: a={solution[0]:.4g} "
            f"b={solution[1]:.4g} c={solution[2]:.4g} (unconstrained)"
        )
        single = [r for r in packed if len(r[8]["lengths"]) == 1]
        if len(single) >= 3:
            a, b, c = fit_cost([r[4] for r in single], [r[5] for r in single])
            print(f"calibrate.fit_cost on single-sample ones: a={a:.4g} b={b:.4g} c={c:.4g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--exchange", type=float, default=0.05, help="planner split_exchange")
    args = parser.parse_args()
    for run in json.loads(Path(args.results).read_text()):
        describe(run, args.exchange)
    return 0


if __name__ == "__main__":
    sys.exit(main())
