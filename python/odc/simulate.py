"""`python -m odc.simulate`: the `odc simulate` command (C++, docs/simulate.md), whose `--plot`
PNG of speedup against GPUs (one line per mode and policy) is drawn here (`--draw`); and the
validation of the simulator against the training runs recorded in docs/results
(`validate_recorded`).

  python -m odc.simulate --lengths data/longalign_like.txt --max-length 65536 --plot speedup.png
  python -m odc.simulate --validate docs/results [--transport data/transport/h200x4_odc_bench.json]
  python -m odc.simulate --curves odc_bench.txt > curves.json   # then odc simulate --transport
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
    # Issue #13 (dev/gpu/issue13.sh) and issue #14 (dev/gpu/issue14.sh at 45b902d).
    "train_mesh_2x2_1.5b_16k_4xh200.json": {
        "lengths": "data/longalign_like.txt",
        "max_length": 16384,
    },
    "train_split_heavy_1.5b_4xh200.json": {"lengths": "data/heavy_tailed.txt"},
    "train_split_longalign_1.5b_4xh200.json": {
        "lengths": "data/longalign_like.txt",
        "max_length": 65536,
    },
    "train_split_constant_1.5b_4xh200.json": {
        "lengths": "data/longalign_like.txt",
        "constant_length": 8192,
    },
}

# Runs the simulator does not model yet, with the reason: validate_recorded lists them as skipped
# (never silently dropped) and the mean error is over the simulated runs only.
NOT_MODELLED_SPLIT = "not simulated: split samples (issue #14) are not modelled by odc simulate yet"
# The NVLink figures of one H200 node, used as the "network" of HSDP runs whose two "nodes" were
# GPUs of one host (issue #13): GB/s per GPU, as --nvlink-gbytes' default.
_ONE_HOST_LINK_GBITS = 290 * 8


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


class CliError(ValueError):
    """`odc simulate` refused: its one-line message and its exit status (2 for bad arguments)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def run_simulate(arguments: Sequence[str]) -> dict:
    """`odc simulate ARGUMENTS --format json`, parsed; CliError (a ValueError) with odc's message
    on failure."""
    result = subprocess.run(
        [cli_path(), "simulate", *arguments, "--format", "json"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        message = result.stderr.strip() or f"odc simulate exited with {result.returncode}"
        raise CliError(message, result.returncode)
    return json.loads(result.stdout)


def _read_lengths(path: Path) -> List[int]:
    lengths = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lengths.append(int(line))
    return lengths


def validate_recorded(
    results_dir: Path, repo: Optional[Path] = None, transport: Optional[str] = None
) -> List[dict]:
    """Simulates every run recorded in `results_dir` on the minibatches it measured (the warm-up
    minibatch excluded, as in the measurement) with its own cost model, model preset, ranks and
    policy, on one node (with `transport`: that curves file for the links within it); returns one
    row per run with measured and simulated seconds per step."""
    # The lengths files the recorded runs name live in the repository that holds docs/results
    # (this module may be installed elsewhere).
    repo = Path(repo) if repo is not None else Path(results_dir).resolve().parents[1]
    rows = []
    files = sorted(Path(results_dir).glob("*.json"))
    if not files:
        raise ValueError(f"no results files in {results_dir}")
    for path in files:
        runs = json.loads(path.read_text())
        inputs = RECORDED_INPUTS.get(path.name)
        lengths = None
        if inputs is not None:
            lengths = _read_lengths(repo / inputs["lengths"])
            if "max_length" in inputs:
                lengths = [n for n in lengths if n <= inputs["max_length"]]
            if "constant_length" in inputs:
                lengths = [inputs["constant_length"]] * len(lengths)
        for run in runs:
            if run.get("split") == "auto":
                rows.append(
                    {
                        "file": path.name,
                        "comm": run["comm"],
                        "policy": run["policy"] + "+split",
                        "minibatches": run["steps_measured"],
                        "measured_step_seconds": run["step_seconds"],
                        "skipped": NOT_MODELLED_SPLIT,
                    }
                )
                continue
            ranks, per_rank = run["ranks"], run["samples_per_rank"]
            per_minibatch = ranks * per_rank
            steps = run["steps_measured"]
            if "measured_lengths" in run:  # odc.train records them since issue #15
                measured_lengths = run["measured_lengths"]
            elif lengths is not None:
                warmup = 1  # odc.train's default; the runs recorded before issue #15 used it
                measured_lengths = lengths[
                    warmup * per_minibatch : (warmup + steps) * per_minibatch
                ]
            else:
                raise ValueError(
                    f"{path.name}: the run records no measured_lengths and is not in "
                    "RECORDED_INPUTS: say how it was made"
                )
            if len(measured_lengths) != steps * per_minibatch:
                raise ValueError(f"{path.name}: expected {steps * per_minibatch} sample lengths")
            # (a, b, c), or (a, b, c, floor) since the seventh round: the simulator takes both.
            cost_text = ",".join(repr(float(v)) for v in run["cost"])
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
                handle.write("\n".join(str(n) for n in measured_lengths) + "\n")
                lengths_path = handle.name
            try:
                mode = "odc" if run["comm"] == "odc" else "collective"
                node_gpus, link = ranks, []
                replicas, shards = run.get("mesh") or (1, ranks)
                if replicas > 1 and run["comm"] == "odc":
                    # ODC hybrid: ODC inside each replica, one all-reduce across replicas, over
                    # NVLink here (both "nodes" were GPUs of one host). Collective HSDP is
                    # simulated as flat collective FSDP on the host: its per-microbatch replica
                    # all-reduce of a few GiB over NVLink is hidden behind backward compute.
                    mode, node_gpus = "odc-hybrid", shards
                    link = ["--network-gbits", str(_ONE_HOST_LINK_GBITS)]
                simulated = run_simulate(
                    [
                        "--lengths", lengths_path, "--model", run["preset"],
                        "--cost", cost_text, "--ranks", str(ranks),
                        "--samples-per-rank", str(per_rank), "--minibatches", str(steps),
                        "--max-tokens", str(run["max_tokens"]), "--policies", run["policy"],
                        "--modes", mode, "--gpus-per-node", str(node_gpus),
                        "--cost-calibrated-on", str(ranks),
                        # The plan the run executed: runs recorded before issue #17's bound
                        # packed LB-Mini up to the cap.
                        "--microbatch-memory", run.get("microbatch_memory", "cap"),
                    ]
                    + link
                    + (["--transport", transport] if transport else [])
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


_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

# odc_bench table titles (bench/odc_bench.cc) and the curves they give: (prefix, odc key, nccl key).
_TABLES = [
    ("gather (bf16) vs ncclAllGather", "gather", "all_gather"),
    ("scatter-accumulate (fp32 -> fp32), back-to-back pushes", "scatter", "reduce_scatter"),
]


def parse_odc_bench(text: str) -> dict:
    """Transport curves from odc_bench's printed tables: per-rank size in bytes against bus
    bandwidth in GB/s, for ODC's gather and back-to-back pushes (how training runs them) and
    NCCL's all-gather and reduce-scatter. ValueError when a table is missing or malformed."""
    curves, ranks, current = {}, None, None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("odc-bench:"):
            ranks = int(stripped.split()[1])
            continue
        matched = [t for t in _TABLES if stripped.startswith(t[0])]
        if matched:
            current = matched[0]
            curves[current[1]], curves[current[2]] = [], []
            continue
        if not stripped:
            current = None  # a blank line ends a table
            continue
        if current is None or stripped.startswith("size"):
            continue
        fields = stripped.split()
        unit = fields[0][-3:]
        if unit not in _UNITS or len(fields) < 5:
            current = None  # a table we do not use
            continue
        try:
            size = float(fields[0][:-3]) * _UNITS[unit]
            odc, nccl = float(fields[2]), float(fields[4])
        except ValueError:
            raise ValueError(f"odc_bench output line {number}: cannot read '{stripped}'") from None
        curves[current[1]].append([size, odc])
        curves[current[2]].append([size, nccl])
    missing = [
        k for k in ("gather", "scatter", "all_gather", "reduce_scatter") if not curves.get(k)
    ]
    if missing:
        raise ValueError(f"odc_bench output has no table for: {', '.join(missing)}")
    return {"source": "odc_bench", "ranks": ranks, "curves": curves}


# Line styles and markers cycled so that lines which coincide (e.g. odc and odc-hybrid on one
# node, where they are the same thing) stay distinguishable: each line gets its own pair.
_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def draw(document: dict, path: str, title: str = "") -> None:
    """Speedup against GPUs (log scale), one line per mode + policy, each with its own line style
    and marker, the legend outside the axes. ImportError without matplotlib, OSError when the
    file cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = {}
    for row in document["results"]:
        if row["speedup"] is None:
            continue
        lines.setdefault(f"{row['mode']} + {row['policy']}", []).append(
            (row["ranks"], row["speedup"])
        )
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for index, (label, points) in enumerate(sorted(lines.items())):
        points.sort()
        axis.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            linestyle=_STYLES[index % len(_STYLES)],
            marker=_MARKERS[index % len(_MARKERS)],
            markerfacecolor="none",
            label=label,
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("GPUs")
    axis.set_ylabel("speedup vs collective + lb-micro")
    axis.set_title(title or "odc simulate: simulated step time, relative to FSDP2 + LB-Micro")
    axis.grid(True, alpha=0.3)
    if lines:
        # Outside the axes, on the right: never over the data.
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def write_plot(document: dict, path: str) -> Optional[str]:
    """draw() into `path`; None without matplotlib."""
    try:
        draw(document, path)
    except ImportError:
        return None
    return path


def _draw_main(argv: List[str]) -> int:
    """`python -m odc.simulate --draw FILE.png [TITLE] < simulate.json`: what `odc simulate
    --plot` runs. Every failure is one line on stderr."""
    if not 1 <= len(argv) <= 2:
        print(
            "usage: python -m odc.simulate --draw FILE.png [TITLE] < simulate.json", file=sys.stderr
        )
        return 2
    try:
        document = json.load(sys.stdin)
        document["results"]
    except (ValueError, KeyError, TypeError) as error:
        print(
            f"odc.simulate: error: stdin is not `odc simulate --format json`: {error}",
            file=sys.stderr,
        )
        return 2
    try:
        draw(document, argv[0], argv[1] if len(argv) > 1 else "")
    except ImportError:
        print(
            "odc.simulate: error: drawing needs matplotlib: pip install matplotlib "
            "(or the extra: pip install 'odc[plot]')",
            file=sys.stderr,
        )
        return 1
    except OSError as error:
        print(
            f"odc.simulate: error: cannot write {argv[0]}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--validate"]:
        transport = None
        if len(argv) == 4 and argv[2] == "--transport":
            transport = argv[3]
        elif len(argv) != 2:
            sys.exit("usage: python -m odc.simulate --validate RESULTS_DIR [--transport CURVES]")
        try:
            rows = validate_recorded(Path(argv[1]), transport=transport)
        except (OSError, ValueError) as error:
            sys.exit(f"odc simulate: {error}")
        print(f"{'file':38} {'comm + policy':24} {'mb':>3} {'measured':>9} {'simulated':>9} "
              f"{'planner':>8} {'error':>7}")  # fmt: skip
        for r in rows:
            label = f"{r['file']:38} {r['comm'] + ' + ' + r['policy']:24} {r['minibatches']:3d} "
            if "skipped" in r:
                print(f"{label}{r['measured_step_seconds']:9.3f}  {r['skipped']}")
                continue
            print(
                f"{label}{r['measured_step_seconds']:9.3f} {r['simulated_step_seconds']:9.3f} "
                f"{r['planner_step_seconds']:8.3f} {100 * r['error']:+6.1f}%"
            )
        skipped = [r for r in rows if "skipped" in r]
        rows = [r for r in rows if "skipped" not in r]
        errors = [abs(r["error"]) for r in rows]
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(
            f"{len(skipped)} runs not simulated (listed above)" if skipped else "",
        )
        print(
            f"mean absolute error {100 * sum(errors) / len(errors):.2f}% over {len(rows)} runs; "
            f"worst {100 * worst['error']:+.2f}% ({worst['file']}, {worst['comm']} + "
            f"{worst['policy']})"
        )
        return 0
    if argv[:1] == ["--curves"]:
        if len(argv) != 2:
            sys.exit("usage: python -m odc.simulate --curves ODC_BENCH_OUTPUT > curves.json")
        try:
            print(json.dumps(parse_odc_bench(Path(argv[1]).read_text())))
        except (OSError, ValueError) as error:
            sys.exit(f"odc simulate: {error}")
        return 0
    if argv[:1] == ["--draw"]:
        return _draw_main(argv[1:])
    # Everything else is `odc simulate` (which has --plot and --format itself since issue 28):
    # its output, its one-line errors and its exit status, unchanged.
    try:
        command = [cli_path(), "simulate", *argv]
    except FileNotFoundError as error:
        sys.exit(f"odc simulate: {error}")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
