"""The simulator against the training runs recorded in docs/results: each run is simulated on
the minibatches it measured (the warm-up excluded, as in the measurement), with its own cost
model, model preset, ranks, arm (comm + policy, odc.train's names: odc simulate's modes) and
policy, on one node, and its simulated step time set beside the measured one. The simulator is
called in this process with a typed request (odc.simulate.sweep, odcSimulateSweep), one per run;
tests/python/test_validate_runs.py bounds the mean error.

GRPO runs (`task: grpo`, odc.train --task grpo) are compared per RL step: the two forward-only
phases (rl.phase_seconds' old_logprobs and ref_logprobs, the slowest rank's) plus the step's K
update minibatches (minibatch_seconds), summed over the measured RL steps and divided by their
number, against odc simulate --task grpo on the same rollouts. The host exchange of the
log-probabilities after each phase (*_exchange) is outside both: the simulator does not model it.

    python dev/analysis/validate_runs.py [docs/results] [--transport data/transport/h200x4_odc_bench.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "python"))  # where odc is not installed (then set ODC_LIBRARY)
from odc.simulate import sweep  # noqa: E402

# How each results file recorded before odc.train kept its lengths was made
# (docs/benchmarks-archive.md gives the commands): the lengths file and the filter its samples went
# through before planning.
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
    # Issue #13 and issue #14 (the retired dev/gpu/issue13.sh and issue14.sh at 45b902d).
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

# Runs the simulator does not model yet, with the reason: they are listed as skipped (never
# silently dropped) and the mean error is over the simulated runs only.
NOT_MODELLED_SPLIT = "not simulated: split samples (issue #14) are not modelled by odc simulate yet"
# GRPO runs whose RL step is not N x samples-per-rank rollouts: odc simulate cannot lay it out.
NOT_MODELLED_STEP = (
    "not simulated: an RL step of {step} rollouts is not a multiple of {ranks} ranks"
)
# A forward's share of forward + backward, as odc.train's grpo_run.FORWARD_FRACTION: with
# activation checkpointing (odc.train turns it on on GPUs) the backward recomputes the forward.
FORWARD_FRACTION = {True: 1 / 4, False: 1 / 3}
# The NVLink figures of one H200 node, used as the "network" of HSDP runs whose two "nodes" were
# GPUs of one host (issue #13): GB/s per GPU, as --nvlink-gbytes' default.
ONE_HOST_LINK_GBITS = 290 * 8


def read_lengths(path: Path) -> List[int]:
    lengths = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lengths.append(int(line))
    return lengths


def file_lengths(name: str, repo: Path) -> Optional[List[int]]:
    """The lengths a results file without measured_lengths was planned from, or None."""
    inputs = RECORDED_INPUTS.get(name)
    if inputs is None:
        return None
    lengths = read_lengths(repo / inputs["lengths"])
    if "max_length" in inputs:
        lengths = [n for n in lengths if n <= inputs["max_length"]]
    if "constant_length" in inputs:
        lengths = [inputs["constant_length"]] * len(lengths)
    return lengths


def measured_lengths(name: str, run: dict, lengths: Optional[List[int]]) -> List[int]:
    """The lengths of the minibatches the run measured, in order."""
    per_minibatch = run["ranks"] * run["samples_per_rank"]
    steps = run["steps_measured"]
    if "measured_lengths" in run:  # odc.train records them since issue #15
        measured = run["measured_lengths"]
    elif lengths is not None:
        warmup = 1  # odc.train's default; the runs recorded before issue #15 used it
        measured = lengths[warmup * per_minibatch : (warmup + steps) * per_minibatch]
    else:
        raise ValueError(
            f"{name}: the run records no measured_lengths and is not in RECORDED_INPUTS: say how "
            "it was made"
        )
    if len(measured) != steps * per_minibatch:
        raise ValueError(f"{name}: expected {steps * per_minibatch} sample lengths")
    return measured


def simulate_options(run: dict, transport: Optional[str]) -> dict:
    """The simulator's request for one recorded run (odc.simulate.sweep's keywords, the fields of
    odcSimulateRequest_t; its lengths are passed beside them). The arm's comm is the simulator's
    mode of the same name (collective, fsdp2-deferred, fsdp2-unsharded, odc); its policy too
    (lb-mini-padded included)."""
    ranks = run["ranks"]
    mode, node_gpus, link = run["comm"], ranks, {}
    replicas, shards = run.get("mesh") or (1, ranks)
    if replicas > 1 and run["comm"] == "odc":
        # ODC hybrid: ODC inside each replica, one all-reduce across replicas, over NVLink here
        # (both "nodes" were GPUs of one host). Collective HSDP is simulated as flat collective
        # FSDP on the host: its per-microbatch replica all-reduce of a few GiB over NVLink is
        # hidden behind backward compute.
        mode, node_gpus = "odc-hybrid", shards
        link = {"network_gbits": float(ONE_HOST_LINK_GBITS)}
    options = dict(
        # (a, b, c), or (a, b, c, floor) since the seventh round: the simulator takes both.
        model=run["preset"], cost=tuple(float(v) for v in run["cost"]), ranks=[ranks],
        samples_per_rank=run["samples_per_rank"], minibatches=run["steps_measured"],
        max_tokens=run["max_tokens"], policies=run["policy"], modes=mode,
        gpus_per_node=node_gpus, cost_calibrated_on=ranks,
        # The plan the run executed: runs recorded before issue #17's bound packed LB-Mini up
        # to the cap.
        microbatch_memory=run.get("microbatch_memory", "cap"),
        **link,
    )  # fmt: skip
    if transport:
        options["transport_path"] = transport
    return options


def activation_checkpointing(run: dict) -> bool:
    """Whether the run recomputed activations: odc.train turns checkpointing on on GPUs
    (__main__: activation_checkpointing=device == "cuda"); a run that records it is believed."""
    return run.get("activation_checkpointing", run.get("device") == "cuda")


def grpo_rl_steps(name: str, run: dict) -> tuple:
    """(measured RL steps, K, rollouts per RL step, and per RL step the measured seconds, of
    them the two forward-only phases' and the K updates') of a GRPO run: the warm-up
    (warmup_steps counts update minibatches, K per RL step) excluded, each part summed over the
    measured RL steps and divided by their number (time-weighted, docs/design.md "Measuring")."""
    rl = run["rl"]
    per_step = rl["minibatches_per_step"]
    if run["steps_measured"] % per_step or run.get("warmup_steps", 0) % per_step:
        raise ValueError(f"{name}: update minibatches are not whole RL steps of {per_step}")
    steps = run["steps_measured"] // per_step
    phases = rl["phase_seconds"][run.get("warmup_steps", 0) // per_step :]
    if len(phases) != steps or len(run["minibatch_seconds"]) != run["steps_measured"]:
        raise ValueError(
            f"{name}: {steps} measured RL steps, but {len(phases)} forward-phase records and "
            f"{len(run['minibatch_seconds'])} update minibatch times"
        )
    forward = sum(p["old_logprobs"] + p["ref_logprobs"] for p in phases)
    update = sum(run["minibatch_seconds"])
    rollouts = rl.get("rollouts_per_step") or (
        len(run["measured_lengths"]) // steps if steps else 0
    )
    if steps == 0 or rollouts * steps != len(run["measured_lengths"]):
        raise ValueError(f"{name}: measured_lengths do not hold {steps} whole RL steps")
    return steps, per_step, rollouts, (forward + update) / steps, forward / steps, update / steps


def grpo_options(run: dict, steps: int, per_step: int, rollouts: int, transport) -> dict:
    """The simulator's request (task grpo) for a GRPO run of `steps` RL steps."""
    options = simulate_options(run, transport)
    options.update(
        samples_per_rank=rollouts // run["ranks"], minibatches=steps, task="grpo",
        minibatches_per_step=per_step,
        forward_fraction=FORWARD_FRACTION[activation_checkpointing(run)],
    )  # fmt: skip
    return options


def validate_grpo(name: str, run: dict, row: dict, transport: Optional[str]) -> dict:
    """The row of a GRPO run: seconds per RL step, measured and simulated, and each part."""
    steps, per_step, rollouts, measured, forward, update = grpo_rl_steps(name, run)
    row.update(
        task="grpo",
        minibatches=steps,
        measured_step_seconds=measured,
        measured_forward_seconds=forward,
        measured_update_seconds=update,
    )
    if rollouts % run["ranks"]:
        row["skipped"] = NOT_MODELLED_STEP.format(step=rollouts, ranks=run["ranks"])
        return row
    options = grpo_options(run, steps, per_step, rollouts, transport)
    try:
        (result,) = sweep(run["measured_lengths"], **options)["results"]
    except ValueError as error:  # an arm odc.train runs and the simulator does not model
        row["skipped"] = f"not simulated: {error}"
        return row
    phases = result["phases"]
    row.update(
        simulated_step_seconds=result["step_seconds"],
        planner_step_seconds=result["planner_step_seconds"],
        simulated_forward_seconds=2 * phases["forward_phase_seconds"],
        simulated_update_seconds=phases["update_seconds"],
        error=result["step_seconds"] / measured - 1.0,
    )
    return row


def validate(
    results_dir: Path, repo: Optional[Path] = None, transport: Optional[str] = None
) -> List[dict]:
    """One row per run recorded in `results_dir`: measured and simulated seconds per step and
    the relative error, or the reason it is not simulated (`skipped`)."""
    # The lengths files the recorded runs name live in the repository that holds docs/results.
    repo = Path(repo) if repo is not None else Path(results_dir).resolve().parents[1]
    files = sorted(Path(results_dir).glob("*.json"))
    if not files:
        raise ValueError(f"no results files in {results_dir}")
    rows = []
    for path in files:
        lengths = file_lengths(path.name, repo)
        for run in json.loads(path.read_text()):
            row = {
                "file": path.name,
                "comm": run["comm"],
                "policy": run["policy"],
                "minibatches": run["steps_measured"],
                "measured_step_seconds": run["step_seconds"],
            }
            if run.get("split") == "auto":
                row.update(policy=run["policy"] + "+split", skipped=NOT_MODELLED_SPLIT)
                rows.append(row)
                continue
            if run.get("task") == "grpo":
                rows.append(validate_grpo(path.name, run, row, transport))
                continue
            measured = measured_lengths(path.name, run, lengths)
            try:
                document = sweep(measured, **simulate_options(run, transport))
            except ValueError as error:  # e.g. odc + lb-mini-padded: odc.train runs it, the
                row["skipped"] = f"not simulated: {error}"  # simulator has no such arm
                rows.append(row)
                continue
            (result,) = document["results"]
            row.update(
                simulated_step_seconds=result["step_seconds"],
                planner_step_seconds=result["planner_step_seconds"],
                error=result["step_seconds"] / run["step_seconds"] - 1.0,
            )
            rows.append(row)
    return rows


def print_rows(rows: List[dict]) -> None:
    print(f"{'file':38} {'comm + policy':24} {'mb':>3} {'measured':>9} {'simulated':>9} "
          f"{'planner':>8} {'error':>7}")  # fmt: skip
    for r in rows:
        arm = r["comm"] + " + " + r["policy"] + (" (grpo)" if r.get("task") == "grpo" else "")
        label = f"{r['file']:38} {arm:24} {r['minibatches']:3d} "
        if "skipped" in r:
            print(f"{label}{r['measured_step_seconds']:9.3f}  {r['skipped']}")
            continue
        print(
            f"{label}{r['measured_step_seconds']:9.3f} {r['simulated_step_seconds']:9.3f} "
            f"{r['planner_step_seconds']:8.3f} {100 * r['error']:+6.1f}%"
        )
    skipped = [r for r in rows if "skipped" in r]
    simulated = [r for r in rows if "skipped" not in r]
    if any(r.get("task") == "grpo" for r in rows):
        print(
            "grpo rows: mb counts RL steps and seconds are per RL step (2 forward-only phases + "
            "K updates)"
        )
    if skipped:
        print(f"{len(skipped)} runs not simulated (listed above)")
    if simulated:
        errors = [abs(r["error"]) for r in simulated]
        worst = max(simulated, key=lambda r: abs(r["error"]))
        print(
            f"mean absolute error {100 * sum(errors) / len(errors):.2f}% over {len(simulated)} "
            f"runs; worst {100 * worst['error']:+.2f}% ({worst['file']}, {worst['comm']} + "
            f"{worst['policy']})"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=str(REPO / "docs" / "results"))
    parser.add_argument("--transport", help="curves JSON within a node (odc simulate --transport)")
    args = parser.parse_args(argv)
    try:
        rows = validate(Path(args.results), transport=args.transport)
    except (OSError, ValueError) as error:
        print(f"validate_runs: error: {error}", file=sys.stderr)
        return 2
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
