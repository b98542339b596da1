"""Tables of what a dev/gpu/run.sh stage wrote (its JSON results), printed into its log.

fit DIR         each fit_1_5b_*.json of `python -m odc.fit`: its --cost through the planner, and
                its measured and predicted microbatch times beside docs/planner.md's 1.5b row
tails DIR       each odc.train result: samples/s, minibatch spans, the tail phases (host ms)
spans DIR       each odc.train result: spans, the last microbatches, the last tail
sm-budget DIR   samples/s per run name (two rounds), against collective, mean microbatch, peak
"""

import json
import statistics
import sys
from pathlib import Path


def fit(folder: Path) -> None:
    import odc

    table = (1.69e-5, 9.75e-10, 0.069)  # docs/planner.md: Qwen2-1.5B shape, one H200
    lengths = odc.read_lengths("data/aime_rl_like.txt")[:256]
    for path in sorted(folder.glob("fit_1_5b_*.json")):
        result = json.loads(path.read_text())
        cost = tuple(result["cost"][k] for k in ("a", "b", "c", "floor"))
        plan = odc.plan(
            lengths, ranks=4, max_tokens=32768, policy="lb-mini", samples_per_rank=16, cost=cost
        )
        print(f"{path.name}: {result['flag']} ({result['model']}); stopped: {result['stopped']}")
        print(f"  odc plan takes it: bubble {plan['bubble']}")
        print(f"  {'tokens':>7} {'measured':>9} {'this fit':>9} {'docs row':>9}")
        for rung in [result["floor_microbatch"], *result["ladder"]]:
            n = rung["tokens"]
            docs = table[2] + table[0] * n + table[1] * n * n
            print(f"  {n:7d} {rung['seconds']:9.4f} {rung['predicted']:9.4f} {docs:9.4f}")


def tails(folder: Path) -> None:
    for path in sorted(folder.glob("*.json")):
        (run,) = json.loads(path.read_text())
        spans = [round(x, 3) for x in run["minibatch_seconds"]]
        print(path.stem, "samples/s", round(run["samples_per_second"], 2), "spans", spans)
        for phases in run["tail_phase_seconds"]:
            print("   tail ms", {k: round(1000 * v, 1) for k, v in phases.items()})


def spans(folder: Path) -> None:
    for path in sorted(folder.glob("*.json")):
        for r in json.loads(path.read_text()):
            minibatches = [round(s, 3) for s in r["minibatch_seconds"]]
            last = [round(b - a, 3) for rank in r["timeline"] for a, b, n in rank]
            print(path.name, r["comm"], r.get("odc_cuda_sms"), "spans", minibatches,
                  "last microbatches", last, "tail", r.get("tail_phase_seconds", [])[-1:])  # fmt: skip


def sm_budget(folder: Path) -> None:
    rows = {}
    for path in sorted(folder.glob("*.json")):
        name = path.stem.rsplit("_", 1)[0]
        (run,) = json.loads(path.read_text())
        durations = [e - b for rank in run["timeline"] for (b, e, _) in rank]
        rows.setdefault(name, []).append(
            (
                run["samples_per_second"],
                statistics.mean(durations),
                run["peak_memory_bytes"] / 2**30,
            )
        )
    base = statistics.mean(r[0] for r in rows.get("collective", [(float("nan"),)]))
    print(f"{'run':12s} {'samples/s (each)':>22s} {'vs collective':>14s} {'microbatch s':>13s} "
          f"{'peak GiB':>9s}")  # fmt: skip
    for name, values in rows.items():
        sps = [v[0] for v in values]
        each = " ".join(f"{x:.2f}" for x in sps)
        print(
            f"{name:12s} {each:>22s} {statistics.mean(sps) / base:13.3f}x "
            f"{statistics.mean(v[1] for v in values):13.3f} {max(v[2] for v in values):9.2f}"
        )


TABLES = {"fit": fit, "tails": tails, "spans": spans, "sm-budget": sm_budget}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in TABLES:
        sys.exit(__doc__)
    TABLES[sys.argv[1]](Path(sys.argv[2]))
