"""`python -m odc.simulate`: the `odc simulate` command (C++, docs/simulate.md) plus a PNG of
speedup against GPUs, one line per policy and mode; and the validation of the simulator against
the training runs recorded in docs/results (`validate_recorded`).

  python -m odc.simulate --lengths data/longalign_like.txt --max-length 65536 --plot speedup.png
  python -m odc.simulate --validate docs/results        # predicted vs measured step time
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]

# How each recorded results file was made (docs/benchmarks.md gives the commands): the lengths
# file and the filter its samples went through before planning.
RECORDED_INPUTS = {
    "train_all_1.5b_64k_4xh200.json": {"lengths": "data/longalign_like.txt", "max_length": 65536},
    "train_compare_1.5b_64k_4xh200.json": {
        "lengths": "data/longalign_like.txt",
        "max_length": 65536,
    },
    "train_compare_7b_32k_4xh200.json": {"lengths": "data/longalign_like.txt", "max_length": 32768},
    "train_compare_7b_64k_4xh200.json": {"lengths": "data/longalign_like.txt", "max_length": 65536},
    "train_control_1.5b_4xh200.json": {
        "lengths": "data/longalign_like.txt",
        "constant_length": 16384,
    },
}


def cli_path() -> str:
    """The `odc` binary: $ODC_CLI, then beside this Python (a virtual environment), PATH, or the
    build tree."""
    candidates = [
        os.environ.get("ODC_CLI"),
        str(Path(sys.executable).parent / "odc"),
        shutil.which("odc"),
        str(REPO / "build" / "cmake" / "odc"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("the odc command was not found: build it or set ODC_CLI")


def run_simulate(arguments: Sequence[str]) -> dict:
    """`odc simulate ARGUMENTS --format json`, parsed; ValueError with odc's message on failure."""
    result = subprocess.run(
        [cli_path(), "simulate", *arguments, "--format", "json"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ValueError(result.stderr.strip() or f"odc simulate exited with {result.returncode}")
    return json.loads(result.stdout)


def _read_lengths(path: Path) -> List[int]:
    lengths = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lengths.append(int(line))
    return lengths


def validate_recorded(results_dir: Path, repo: Path = REPO) -> List[dict]:
    """Simulates every run recorded in `results_dir` on the minibatches it measured (the warm-up
    minibatch excluded, as in the measurement) with its own cost model, model preset, ranks and
    policy, on one node; returns one row per run with measured and simulated seconds per step."""
    rows = []
    files = sorted(Path(results_dir).glob("*.json"))
    if not files:
        raise ValueError(f"no results files in {results_dir}")
    for path in files:
        inputs = RECORDED_INPUTS.get(path.name)
        if inputs is None:
            raise ValueError(
                f"{path.name}: unknown recorded run; add how it was made to RECORDED_INPUTS"
            )
        lengths = _read_lengths(repo / inputs["lengths"])
        if "max_length" in inputs:
            lengths = [n for n in lengths if n <= inputs["max_length"]]
        if "constant_length" in inputs:
            lengths = [inputs["constant_length"]] * len(lengths)
        for run in json.loads(path.read_text()):
            ranks, per_rank = run["ranks"], run["samples_per_rank"]
            per_minibatch = ranks * per_rank
            warmup = 1  # odc.train's default; the recorded runs used it
            steps = run["steps_measured"]
            measured_lengths = lengths[warmup * per_minibatch : (warmup + steps) * per_minibatch]
            a, b, c = run["cost"]
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
                handle.write("\n".join(str(n) for n in measured_lengths) + "\n")
                lengths_path = handle.name
            try:
                mode = "odc" if run["comm"] == "odc" else "collective"
                simulated = run_simulate(
                    [
                        "--lengths", lengths_path, "--model", run["preset"],
                        "--cost", f"{a!r},{b!r},{c!r}", "--ranks", str(ranks),
                        "--samples-per-rank", str(per_rank), "--minibatches", str(steps),
                        "--max-tokens", str(run["max_tokens"]), "--policies", run["policy"],
                        "--modes", mode, "--gpus-per-node", str(ranks),
                        "--cost-calibrated-on", str(ranks),
                    ]
                )  # fmt: skip
            finally:
                os.unlink(lengths_path)
            (result,) = simulated["results"]
            rows.append(
                {
                    "file": path.name,
                    "comm": run["comm"],
                    "policy": run["policy"],
                    "minibatches": steps,
                    "measured_step_seconds": run["step_seconds"],
                    "simulated_step_seconds": result["step_seconds"],
                    "planner_step_seconds": result["planner_step_seconds"],
                    "error": result["step_seconds"] / run["step_seconds"] - 1.0,
                }
            )
    return rows


def write_plot(document: dict, path: str) -> Optional[str]:
    """Speedup against GPUs (log scale), one line per policy + mode; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lines = {}
    for row in document["results"]:
        if row["speedup"] is None:
            continue
        lines.setdefault(f"{row['mode']} + {row['policy']}", []).append(
            (row["ranks"], row["speedup"])
        )
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("GPUs")
    axis.set_ylabel("speedup vs collective + lb-micro")
    axis.set_title("odc simulate: simulated step time, relative to FSDP2 + LB-Micro")
    axis.grid(True, alpha=0.3)
    if lines:
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--validate"]:
        if len(argv) != 2:
            sys.exit("usage: python -m odc.simulate --validate RESULTS_DIR")
        try:
            rows = validate_recorded(Path(argv[1]))
        except (OSError, ValueError) as error:
            sys.exit(f"odc simulate: {error}")
        print(f"{'file':38} {'comm + policy':24} {'mb':>3} {'measured':>9} {'simulated':>9} "
              f"{'planner':>8} {'error':>7}")  # fmt: skip
        for r in rows:
            print(
                f"{r['file']:38} {r['comm'] + ' + ' + r['policy']:24} {r['minibatches']:3d} "
                f"{r['measured_step_seconds']:9.3f} {r['simulated_step_seconds']:9.3f} "
                f"{r['planner_step_seconds']:8.3f} {100 * r['error']:+6.1f}%"
            )
        errors = [abs(r["error"]) for r in rows]
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(
            f"mean absolute error {100 * sum(errors) / len(errors):.2f}% over {len(rows)} runs; "
            f"worst {100 * worst['error']:+.2f}% ({worst['file']}, {worst['comm']} + "
            f"{worst['policy']})"
        )
        return 0
    plot = None
    if "--plot" in argv:
        index = argv.index("--plot")
        if index + 1 >= len(argv):
            sys.exit("odc simulate: --plot needs a file name")
        plot = argv[index + 1]
        del argv[index : index + 2]
    if "--format" in argv:
        sys.exit("odc simulate: python -m odc.simulate prints the table; use odc simulate for JSON")
    try:
        document = run_simulate(argv)
    except (OSError, ValueError) as error:
        sys.exit(f"odc simulate: {error}")
    table = subprocess.run([cli_path(), "simulate", *argv], capture_output=True, text=True)
    print(table.stdout, end="")
    if plot:
        written = write_plot(document, plot)
        print(f"plot: {written}" if written else "plot: skipped (matplotlib missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
