"""odc.train over NVSHMEM on pretended nodes against FSDP2 and the CUDA transport (issue #31 items 2
and 3), one torchrun per arm on every GPU of the machine, so each process's driver memory is that
arm's alone. Same data, plan (--policy lb-micro: the plan FSDP2 runs), cost and steps in every arm.
The stage `nvshmem-train` of dev/gpu/run.sh drives it; the table part runs on any CPU.

  arm NAME DIR   runs one arm under torchrun, sampling every process's GPU memory as the driver
                 counts it (nvidia-smi --query-compute-apps) every 200 ms; writes DIR/NAME.json
                 (odc.train's results), DIR/NAME.stderr (the ranks' stderr: odc's byte counters)
                 and DIR/NAME.samples (the sampler's raw output)
  table DIR      the table of every arm found in DIR; writes DIR/nvshmem_train.json and .txt

Arms (NAME, optionally with "-7b": the 7b preset): fsdp2 (--comm collective), cuda (ODC over the
CUDA transport, one node), nvshmem-flat (ODC over NVSHMEM, nodes of half the GPUs, node cache and
aggregation off), nvshmem-nodes (the same with the node cache at its default and node-aggregated
pushes with a 1 GiB budget). Knobs: NVTRAIN_STEPS (measured minibatches, default 4; 7b: 3),
NVTRAIN_MAX_LENGTH (1.5b: 65536), NVTRAIN_7B_MAX_LENGTH (32768), NVTRAIN_POLICY (lb-micro).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

GIB = 1 << 30
SAMPLE_SECONDS = 0.2
# The 1.5b cost fit the other training stages give (run.sh train_1_5b): the plan, not the
# prediction, matters here, and a given cost makes it the same in every arm.
COST = "3.123e-05,1.187e-09,0.07082"
# nvshmem-one-node: NVSHMEM with every rank on one node (every peer mapped directly, pushes still
# streamed through the staging rings): against cuda it prices the streaming, against
# nvshmem-flat the gathers and puts to the other pretended node (not in the default set).
ARMS = ("fsdp2", "cuda", "nvshmem-flat", "nvshmem-nodes", "nvshmem-one-node")
STATS = {"ODC_NVSHMEM_STATS": "1", "ODC_NODE_STATS": "1"}
NVSHMEM_LINE = re.compile(
    r"odc nvshmem rank (\d+): to/from other nodes: (\d+) bytes put, (\d+) bytes fetched"
)
CORE_LINE = re.compile(
    r"odc rank (\d+): streamed chunks to other nodes: (\d+) bytes during minibatches, "
    r"(\d+) bytes in minibatch_end \((\d+) minibatches\)"
)
HEAP_LINE = re.compile(r"odc\.train: NVSHMEM heap ([\d.]+) GiB per GPU")
# Every process on the GPUs: pid, MiB, GPU (the sampler's lines; the check before an arm).
APPS_QUERY = [
    "nvidia-smi",
    "--query-compute-apps=pid,used_memory,gpu_uuid",
    "--format=csv,noheader,nounits",
]


# -- running an arm (GPU machine) ------------------------------------------------------------
def _gpus() -> List[str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split(",")[1].strip() for line in out.splitlines() if line.strip()]


def _ranks_per_node(num_gpus: int) -> int:
    """Two pretended nodes where the GPUs split evenly (4: 2 x 2, 2: 2 x 1), else one per GPU."""
    return num_gpus // 2 if num_gpus % 2 == 0 else 1


def arm_command(name: str, num_gpus: int, output: Path, environ=os.environ):
    """(argv, environment changes, environment removals) of one arm."""
    base = name[: -len("-7b")] if name.endswith("-7b") else name
    seven = name.endswith("-7b")
    if base not in ARMS:
        raise SystemExit(f"nvshmem_train.py: unknown arm {name!r} (one of {', '.join(ARMS)}, -7b)")
    steps = environ.get("NVTRAIN_STEPS", "3" if seven else "4")
    if seven:
        preset, max_length = "7b", environ.get("NVTRAIN_7B_MAX_LENGTH", "32768")
    else:
        preset, max_length = "1.5b", environ.get("NVTRAIN_MAX_LENGTH", "65536")
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(num_gpus), "-m", "odc.train",
        "--preset", preset, "--lengths", "data/longalign_like.txt", "--max-length", max_length,
        "--samples-per-rank", "4", "--steps", steps, "--cost", COST, "--timeline", "",
        "--comm", "collective" if base == "fsdp2" else "odc",
        "--policy", environ.get("NVTRAIN_POLICY", "lb-micro"), "--output", str(output),
    ]  # fmt: skip
    nodes = {"ODC_LOCAL_WORLD_SIZE": str(_ranks_per_node(num_gpus))}
    env = {
        "fsdp2": {},
        "cuda": {"ODC_TRANSPORT": "cuda"},
        "nvshmem-flat": {
            "ODC_TRANSPORT": "nvshmem",
            "ODC_NODE_CACHE_BYTES": "0",
            "ODC_NODE_AGGREGATION_BYTES": "0",
            **nodes,
        },
        "nvshmem-nodes": {"ODC_TRANSPORT": "nvshmem", "ODC_NODE_AGGREGATION_BYTES": "1G", **nodes},
        "nvshmem-one-node": {
            "ODC_TRANSPORT": "nvshmem",
            "ODC_LOCAL_WORLD_SIZE": str(num_gpus),
            "ODC_NODE_AGGREGATION_BYTES": "0",
        },
    }[base]
    remove = [k for k in ("ODC_LOCAL_WORLD_SIZE", "ODC_NODE_CACHE_BYTES") if k not in env]
    if base != "fsdp2":
        env = {**env, **STATS}
    return argv, env, remove


def _sampler(path: Path, stop: threading.Event) -> None:
    """Appends nvidia-smi's per-process memory to `path` every SAMPLE_SECONDS, one block per
    sample ("# t=SECONDS" then pid, MiB, GPU uuid lines), flushed as it goes (a killed arm keeps
    what was sampled)."""
    start = time.monotonic()
    with path.open("a") as out:
        while not stop.is_set():
            try:
                text = subprocess.run(APPS_QUERY, capture_output=True, text=True, timeout=10).stdout
            except subprocess.TimeoutExpired:
                text = ""
            out.write(f"# t={time.monotonic() - start:.2f}\n{text}")
            out.flush()
            stop.wait(SAMPLE_SECONDS)


def run_arm(name: str, folder: Path) -> int:
    gpus = _gpus()
    if len(gpus) < 2:
        print("nvshmem_train.py: needs 2+ GPUs (one process per GPU, two pretended nodes)")
        return 2
    # A process of an earlier arm still on a GPU (a rank hung in a driver call outlives its
    # torchrun's kill) takes memory and SMs from this one: refuse rather than measure that.
    left = subprocess.run(APPS_QUERY, capture_output=True, text=True).stdout.strip()
    if left:
        print(f"nvshmem_train.py: {name}: processes still on the GPUs (pid, MiB, GPU): {left}")
        return 3
    folder.mkdir(parents=True, exist_ok=True)
    output, stderr_path = folder / f"{name}.json", folder / f"{name}.stderr"
    samples = folder / f"{name}.samples"
    for stale in (output, stderr_path, samples):
        stale.unlink(missing_ok=True)  # odc.train refuses to overwrite its output
    argv, changes, removals = arm_command(name, len(gpus), output)
    env = {k: v for k, v in os.environ.items() if k not in removals}
    env.update(changes)
    samples.write_text("".join(f"# gpu {i} {uuid}\n" for i, uuid in enumerate(gpus)))
    print(f"{name}: {' '.join(f'{k}={v}' for k, v in changes.items())} {' '.join(argv)}")
    stop = threading.Event()
    thread = threading.Thread(target=_sampler, args=(samples, stop), daemon=True)
    thread.start()
    code = 1
    try:
        with stderr_path.open("w") as err:
            # The ranks' stderr to the file (odc's counters, the heap line) and to the log.
            process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
            for line in process.stderr:
                err.write(line)
                err.flush()
                sys.stdout.write(line)
            code = process.wait()
    finally:
        stop.set()
        thread.join(timeout=15)
    print(f"{name}: exit {code}")
    return code


# -- the table (any machine) -----------------------------------------------------------------
def driver_peaks(samples_text: str) -> Dict[int, dict]:
    """Per GPU index: the largest memory (MiB) one process held there as the driver counts it
    (summed over the GPUs that process used, sample by sample: a context on a second GPU counts
    too), with that process's pid. The sampler's text: '# gpu INDEX UUID' lines, then per sample
    '# t=...' and 'pid, MiB, uuid' lines. A process's GPU is the one where it held the most."""
    index_of: Dict[str, int] = {}
    best: Dict[int, dict] = {}

    def close(sample: Dict[int, Dict[int, int]]) -> None:
        for pid, per_gpu in sample.items():
            gpu = max(per_gpu, key=per_gpu.get)
            total = sum(per_gpu.values())
            if total > best.get(gpu, {}).get("peak_mib", -1):
                best[gpu] = {"peak_mib": total, "pid": pid}

    sample: Dict[int, Dict[int, int]] = {}
    for line in samples_text.splitlines():
        line = line.strip()
        if line.startswith("# gpu "):
            _, _, index, uuid = line.split()
            index_of[uuid] = int(index)
        elif line.startswith("# t="):
            close(sample)
            sample = {}
        elif line:
            fields = [f.strip() for f in line.split(",")]
            if len(fields) < 3 or not fields[0].isdigit() or not fields[1].isdigit():
                continue  # "[N/A]" or a message instead of a row
            gpu = index_of.get(fields[2], -1)
            per_gpu = sample.setdefault(int(fields[0]), {})
            per_gpu[gpu] = per_gpu.get(gpu, 0) + int(fields[1])
    close(sample)
    return dict(sorted(best.items()))


def parse_stderr(text: str) -> dict:
    """odc's counters printed at close, per rank (bytes summed where a rank printed several lines,
    one per communicator; their minibatches are the same ones, so the most any line says), and
    the heap odc.train reported. Absent lines leave their entries empty."""
    nvshmem: Dict[int, dict] = {}
    for rank, put, fetched in NVSHMEM_LINE.findall(text):
        entry = nvshmem.setdefault(int(rank), {"put": 0, "fetched": 0})
        entry["put"] += int(put)
        entry["fetched"] += int(fetched)
    core: Dict[int, dict] = {}
    for rank, during, at_end, minibatches in CORE_LINE.findall(text):
        entry = core.setdefault(int(rank), {"during": 0, "at_end": 0, "minibatches": 0})
        entry["during"] += int(during)
        entry["at_end"] += int(at_end)
        entry["minibatches"] = max(entry["minibatches"], int(minibatches))
    heap = HEAP_LINE.search(text)
    return {
        "nvshmem": dict(sorted(nvshmem.items())),
        "core": dict(sorted(core.items())),
        "heap_gib": float(heap.group(1)) if heap else None,
    }


def summarize_arm(name: str, result: Optional[dict], stderr: str, samples: str) -> dict:
    """One arm's row: times and memory from odc.train's result (None: the run failed), driver
    peaks from the samples, bytes to other nodes per rank and minibatch from stderr."""
    stats = parse_stderr(stderr)
    peaks = driver_peaks(samples)
    row = {"arm": name, "ok": result is not None, "heap_gib": stats["heap_gib"]}
    row["driver_peak_gib_per_rank"] = {g: p["peak_mib"] / 1024 for g, p in peaks.items()}
    row["driver_peak_gib"] = max(row["driver_peak_gib_per_rank"].values(), default=None)
    minibatches = None
    if result is not None:
        seconds = result["minibatch_seconds"]
        memory = result.get("memory", {})
        row.update(
            minibatch_seconds=seconds,
            seconds_total=sum(seconds),
            seconds_median=statistics.median(seconds),
            torch_peak_gib=memory.get("torch_peak_bytes", 0) / GIB,
            torch_reserved_gib=(
                memory["torch_reserved_bytes"] / GIB if "torch_reserved_bytes" in memory else None
            ),
            odc_symmetric_gib=memory.get("odc_total_bytes", 0) / GIB,
            peak_gib=result["peak_memory_bytes"] / GIB,
            ranks=result["ranks"],
            losses=result.get("losses"),
        )
        minibatches = result.get("warmup_steps", 0) + result["steps_measured"]
    core = stats["core"]
    if core:  # the core's own count of the minibatches its counters span
        minibatches = max(c["minibatches"] for c in core.values()) or minibatches
    row["minibatches_counted"] = minibatches
    per = max(minibatches or 1, 1)
    row["put_gb_per_minibatch"] = {r: s["put"] / per / 1e9 for r, s in stats["nvshmem"].items()}
    row["fetched_gb_per_minibatch"] = {
        r: s["fetched"] / per / 1e9 for r, s in stats["nvshmem"].items()
    }
    row["sent_before_end_percent"] = {
        r: 100.0 * c["during"] / (c["during"] + c["at_end"])
        for r, c in core.items()
        if c["during"] + c["at_end"] > 0
    }
    row["streamed_gb_per_minibatch"] = {
        r: (c["during"] + c["at_end"]) / per / 1e9 for r, c in core.items()
    }
    return row


def compare(rows: List[dict]) -> dict:
    """Ratios between arms: driver peak against FSDP2's (same preset), step time against the CUDA
    transport's (sum over the same minibatches, and the range of per-minibatch ratios)."""
    by_name = {row["arm"]: row for row in rows}
    for row in rows:
        suffix = "-7b" if row["arm"].endswith("-7b") else ""
        fsdp2, cuda = by_name.get("fsdp2" + suffix), by_name.get("cuda" + suffix)
        if fsdp2 and fsdp2.get("driver_peak_gib") and row.get("driver_peak_gib"):
            row["driver_vs_fsdp2"] = row["driver_peak_gib"] / fsdp2["driver_peak_gib"]
        if fsdp2 and fsdp2.get("peak_gib") and row.get("peak_gib"):
            row["peak_vs_fsdp2"] = row["peak_gib"] / fsdp2["peak_gib"]
        if cuda and cuda.get("seconds_total") and row.get("seconds_total"):
            row["time_vs_cuda"] = row["seconds_total"] / cuda["seconds_total"]
            pairs = zip(row["minibatch_seconds"], cuda["minibatch_seconds"])
            ratios = [a / b for a, b in pairs if b > 0]
            row["time_vs_cuda_range"] = [min(ratios), max(ratios)] if ratios else None
    return {"arms": rows}


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _spread(values: dict, spec: str) -> str:
    """min-max over ranks (one value when equal)."""
    if not values:
        return "-"
    low, high = min(values.values()), max(values.values())
    return (
        format(low, spec) if f"{low:{spec}}" == f"{high:{spec}}" else f"{low:{spec}}-{high:{spec}}"
    )


def format_table(summary: dict) -> str:
    rows = summary["arms"]
    head = (
        f"{'arm':17s} {'med s':>6s} {'sum s':>7s} {'vs cuda':>18s} {'torch':>6s} {'resvd':>6s} {'odc':>5s} "
        f"{'heap':>5s} {'peak':>6s} {'driver':>7s} {'vs fsdp2':>8s} {'driver per rank':>24s}"
    )
    lines = [
        "time: seconds per measured minibatch (median, sum); vs cuda: sum against the CUDA "
        "transport's [per-minibatch range]",
        "memory GiB per GPU: torch peak, torch reserved (the caching allocator's hold at the end), "
        "odc symmetric, NVSHMEM heap, peak = torch + odc (odc.train),"
        " driver = nvidia-smi per process (max over ranks), vs fsdp2 = driver against FSDP2's",
        head,
        "-" * len(head),
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(
                f"{r['arm']:17s} FAILED (no results; driver peak {_fmt(r['driver_peak_gib'], '.2f')})"
            )
            continue
        versus = "-"
        if r.get("time_vs_cuda") is not None:
            low, high = r.get("time_vs_cuda_range") or (r["time_vs_cuda"],) * 2
            versus = f"{r['time_vs_cuda']:.3f} [{low:.2f}-{high:.2f}]"
        per_rank = " ".join(f"{v:.1f}" for v in r["driver_peak_gib_per_rank"].values())
        lines.append(
            f"{r['arm']:17s} {r['seconds_median']:6.3f} {r['seconds_total']:7.3f} {versus:>18s} "
            f"{r['torch_peak_gib']:6.2f} {_fmt(r.get('torch_reserved_gib'), '6.2f'):>6s} "
            f"{r['odc_symmetric_gib']:5.2f} {_fmt(r['heap_gib'], '5.2f'):>5s} "
            f"{r['peak_gib']:6.2f} {_fmt(r['driver_peak_gib'], '7.2f'):>7s} "
            f"{_ratio(r.get('driver_vs_fsdp2')):>8s} {per_rank:>24s}"
        )  # fmt: skip
    bytes_rows = [r for r in rows if r["put_gb_per_minibatch"] or r["sent_before_end_percent"]]
    if bytes_rows:
        lines += [
            "",
            "to other nodes, GB per rank per minibatch (min-max over ranks): NVSHMEM put and "
            "fetched (ODC_NVSHMEM_STATS); the core's streamed chunks and the % of them sent "
            "before minibatch_end (ODC_NODE_STATS)",
            f"{'arm':17s} {'put':>11s} {'fetched':>11s} {'streamed':>11s} {'% before end':>13s} "
            f"{'minibatches':>11s}",
        ]
        for r in bytes_rows:
            lines.append(
                f"{r['arm']:17s} {_spread(r['put_gb_per_minibatch'], '.2f'):>11s} "
                f"{_spread(r['fetched_gb_per_minibatch'], '.2f'):>11s} "
                f"{_spread(r['streamed_gb_per_minibatch'], '.2f'):>11s} "
                f"{_spread(r['sent_before_end_percent'], '.1f'):>13s} "
                f"{_fmt(r['minibatches_counted'], 'd'):>11s}"
            )
    lines += ["", "issue #31's targets:"]
    for r in rows:
        if not r["ok"] or "nvshmem" not in r["arm"]:
            continue
        before = r["sent_before_end_percent"]
        lines.append(
            f"  {r['arm']}: step time {_ratio(r.get('time_vs_cuda'))} the CUDA transport's "
            f"(target <= 1.05x), driver peak {_ratio(r.get('driver_vs_fsdp2'))} FSDP2's "
            f"(target <= 1.10x), sent before minibatch_end "
            f"{_fmt(min(before.values()) if before else None, '.1f')}% on the lowest rank "
            "(target >= 80%)"
        )
    return "\n".join(lines)


def _arm_names(folder: Path) -> List[str]:
    order = [a + s for s in ("", "-7b") for a in ARMS]
    found = {p.name[: -len(".stderr")] for p in folder.glob("*.stderr")}
    found |= {p.stem for p in folder.glob("*.json") if p.stem != "nvshmem_train"}
    return [a for a in order if a in found]


def table(folder: Path) -> str:
    rows = []
    for name in _arm_names(folder):
        result_path = folder / f"{name}.json"
        result = None
        if result_path.exists():
            runs = json.loads(result_path.read_text())
            result = runs[0] if runs else None

        def text(suffix: str) -> str:
            path = folder / f"{name}{suffix}"
            return path.read_text(errors="replace") if path.exists() else ""

        rows.append(summarize_arm(name, result, text(".stderr"), text(".samples")))
    summary = compare(rows)
    printed = format_table(summary)
    (folder / "nvshmem_train.json").write_text(json.dumps(summary, indent=1) + "\n")
    (folder / "nvshmem_train.txt").write_text(printed + "\n")
    return printed


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "arm":
        sys.exit(run_arm(sys.argv[2], Path(sys.argv[3])))
    if len(sys.argv) == 3 and sys.argv[1] == "table":
        print(table(Path(sys.argv[2])))
        sys.exit(0)
    sys.exit(__doc__)
