"""`python -m odc.simulate`: the `odc simulate` command (C++, docs/simulate.md), whose `--plot`
PNG of speedup against GPUs (one line per mode and policy) is drawn here (`--draw`); `sweep()`,
the same simulator called in this process with a typed request (odcSimulateSweep), and
`simulate()`, the same from the command's options (odcSimulate); and the conversion of
odc_bench's tables into transport curves (`--curves`). The validation of the simulator against
the runs recorded in docs/results is repository tooling: dev/analysis/validate_runs.py.

  python -m odc.simulate --lengths data/longalign_like.txt --max-length 65536 --plot speedup.png
  python -m odc.simulate --curves odc_bench.txt > curves.json   # then odc simulate --transport
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from ._plot_cli import draw_from_stdin
from .errors import InvalidArgument


def cli_path() -> str:
    """The `odc` binary: $ODC_CLI, then beside this Python (a virtual environment), then PATH."""
    candidates = [
        os.environ.get("ODC_CLI"),
        str(Path(sys.executable).parent / "odc"),
        shutil.which("odc"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("the odc command was not found: build it or set ODC_CLI")


def simulate(arguments: Sequence[str], lengths: Optional[Sequence[int]] = None) -> dict:
    """`odc simulate ARGUMENTS --format json`, computed in this process through the C API
    (odcSimulate): the parsed document. `lengths`, when given, are the samples' lengths in place
    of a --lengths file. A ValueError (odc.InvalidArgument) with odc's message when it refuses."""
    from . import _capi

    encoded = [str(a).encode() for a in arguments]
    args = (ctypes.c_char_p * max(1, len(encoded)))(*encoded)
    values, count = None, 0
    if lengths is not None:
        count = len(lengths)
        values = (ctypes.c_int64 * max(1, count))(*lengths)
    document = ctypes.c_void_p()
    _capi.check(_capi.lib.odcSimulate(args, len(encoded), values, count, ctypes.byref(document)))
    try:
        return json.loads(ctypes.string_at(document.value).decode())
    finally:
        _capi.lib.odcSimulateFree(document)


# sweep()'s keywords that are not plain numbers of odcSimulateRequest_t, and how they are set.
_NAMES = {
    "task": {"sft": 0, "grpo": 1},  # odcSimulateTask_t
    "split": {"off": 0, "auto": 1},  # odcSplit_t
    "microbatch_memory": {"lb-micro": 0, "cap": 1},  # odcMicrobatchMemory_t
}
_TEXT = ("model", "policies", "modes", "transport_path")
# Fields set from other arguments (the header, the lengths, the lists' sizes).
_NOT_OPTIONS = ("size", "magic", "version", "lengths", "num_samples", "num_rank_counts")
_NOT_OPTIONS += ("num_rank_speeds",)


def _request(lengths: Sequence[int], options: dict, keep: list):
    """odcSimulateRequest_t from sweep()'s arguments; `keep` holds the arrays it points to."""
    from . import _capi

    request = _capi.new_simulate_request()
    values = (ctypes.c_int64 * max(1, len(lengths)))(*lengths)
    keep.append(values)
    request.lengths, request.num_samples = values, len(lengths)
    for name, value in options.items():
        if name == "ranks" or name == "rank_speed":
            kind = ctypes.c_int64 if name == "ranks" else ctypes.c_double
            array = (kind * max(1, len(value)))(*value)
            keep.append(array)
            setattr(request, name, array)
            setattr(
                request, "num_rank_counts" if name == "ranks" else "num_rank_speeds", len(value)
            )
        elif name == "cost":
            terms = list(value) + [0.0] * (4 - len(value))
            if len(value) not in (3, 4):
                raise InvalidArgument(f"cost is (a, b, c) or (a, b, c, floor), got {value!r}")
            request.cost_a, request.cost_b, request.cost_c, request.cost_floor = terms
        elif name in _NAMES:
            if value not in _NAMES[name]:
                expected = " or ".join(_NAMES[name])
                raise InvalidArgument(f"unknown {name} {value!r}: expected {expected}")
            setattr(request, name, _NAMES[name][value])
        elif name in _TEXT:
            text = ",".join(value) if isinstance(value, (list, tuple)) else value
            setattr(request, name, str(text).encode())
        elif name in dict(_capi.SimulateRequest._fields_) and name not in _NOT_OPTIONS:
            setattr(request, name, value)
        else:
            raise InvalidArgument(f"sweep() has no option {name!r}")
    return request


def sweep(lengths: Sequence[int], **options) -> dict:
    """`odc simulate`'s document for the samples' `lengths`, computed in this process from a typed
    request (odcSimulateSweep): the options are odcSimulateRequest_t's fields, named as the
    command's options with underscores (ranks=[8, 64], policies=["lb-micro", "lb-mini"],
    task="grpo", cost=(a, b, c), split="auto", ...); unset, the command's defaults. A ValueError
    (odc.InvalidArgument) with odc's message when it refuses."""
    from . import _capi

    keep: list = []
    request = _request(lengths, options, keep)
    document = ctypes.c_void_p()
    _capi.check(_capi.lib.odcSimulateSweep(ctypes.byref(request), ctypes.byref(document)))
    try:
        return json.loads(ctypes.string_at(document.value).decode())
    finally:
        _capi.lib.odcSimulateFree(document)


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
            raise InvalidArgument(
                f"odc_bench output line {number}: cannot read '{stripped}'"
            ) from None
        curves[current[1]].append([size, odc])
        curves[current[2]].append([size, nccl])
    missing = [
        k for k in ("gather", "scatter", "all_gather", "reduce_scatter") if not curves.get(k)
    ]
    if missing:
        raise InvalidArgument(f"odc_bench output has no table for: {', '.join(missing)}")
    return {"source": "odc_bench", "ranks": ranks, "curves": curves}


# Line styles and markers cycled so that lines which coincide (e.g. odc and odc-hybrid on one
# node, where they are the same thing) stay distinguishable: each line gets its own pair, the
# marker changing fastest, so 32 lines (5 modes x 4 policies, and split arms) never share one.
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
            linestyle=_STYLES[(index // len(_MARKERS)) % len(_STYLES)],
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
    usage = "python -m odc.simulate --draw FILE.png [TITLE] < simulate.json"
    return draw_from_stdin("odc.simulate", usage, "simulate", "results", draw, argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    # Everything else is `odc simulate` (which has --plot and --format itself):
    # its output, its one-line errors and its exit status, unchanged.
    try:
        command = [cli_path(), "simulate", *argv]
    except FileNotFoundError as error:
        sys.exit(f"odc simulate: {error}")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
