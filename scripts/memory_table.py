"""Memory per GPU of odc's layouts against FSDP2, as docs/multinode.md "Does it fit?" shows it.

Every number comes from `odc simulate --format json` (its `memory_per_gpu`, i.e. `memory_per_gpu`
in src/simulate/simulate.h); the two flat-ODC columns the simulator does not print are derived
from its odc row with the runtime's budgets (docs/multinode.md "Choosing"):
  - flat, node cache off: the odc row less its node cache (odc bufs - the staging budget);
  - flat, node schemes sized to the model: node cache off, plus rows for every remote parameter
    shard (4 P (R - 1) / N) and relay rows for every gradient (4 P (R - 1) / N).
Activations are not in any column. Usage: python scripts/memory_table.py [--odc PATH] [--gpu-gb G]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8
RANKS = (16, 64, 256)
STAGING_BUDGET_BYTES = 256 * 2**20  # kStagingBudgetBytes (ODC_STAGING_BYTES' default)
PULL_BYTES = 4  # kPullBytes: fp32 shards cross nodes and sit in the cache; relay rows are fp32

# (name, odc simulate's model arguments). Qwen2-style counts as model_preset() makes them: per
# layer 2 h^2 + 2 h kv + 3 h i, plus embeddings and an untied head (2 h v).
MODELS = (
    ("7B", ["--model", "7b"]),  # odc's preset: Qwen2-7B, 28 x 233.0M + 1.09B = 7.6B
    # Qwen2.5-14B-like (h 5120, kv 1024, i 13824, v 152064): 48 x 275.3M + 1.56B = 14.8B
    ("14B", ["--layers", "48", "--layer-params", "275251200", "--other-params", "1557135360"]),
    # Llama-3-70B-like (h 8192, kv 1024, i 28672, v 128256): 80 x 855.6M + 2.10B = 70.6B
    ("70B", ["--layers", "80", "--layer-params", "855638016", "--other-params", "2101346304"]),
)


def simulate(odc: str, model_args: list[str]) -> dict:
    command = [
        odc, "simulate", "--lengths", str(REPO / "data" / "longalign_like.txt"), *model_args,
        # The cost model changes times, never memory; one value for every model.
        "--cost", "0.0002,5e-9,0.2",
        "--ranks", ",".join(map(str, RANKS)), "--gpus-per-node", str(GPUS_PER_NODE),
        "--modes", "collective,fsdp2-deferred,odc,odc-hybrid", "--policies", "lb-micro,lb-mini",
        "--samples-per-rank", "1", "--minibatches", "1", "--format", "json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"memory_table: {' '.join(command)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def rows(document: dict) -> list[dict]:
    model = document["model"]
    params = model["layers"] * model["layer_params"] + model["other_params"]
    by_key = {(row["ranks"], row["mode"]): row for row in document["memory_per_gpu"]}
    out = []
    for ranks in RANKS:
        nodes = math.ceil(ranks / GPUS_PER_NODE)
        odc = by_key[(ranks, "odc")]
        staging = STAGING_BUDGET_BYTES if nodes > 1 else 0
        cache_at_default = odc["odc_bytes"] - staging
        flat = odc["total_bytes"] - cache_at_default
        rows_per_buffer = PULL_BYTES * params * (nodes - 1) / ranks
        out.append(
            {
                "ranks": ranks,
                "params": params,
                "fsdp2": by_key[(ranks, "collective")]["total_bytes"],
                "fsdp2_deferred": by_key[(ranks, "fsdp2-deferred")]["total_bytes"],
                "flat": flat,
                "flat_default": odc["total_bytes"],
                "flat_sized": flat + 2 * rows_per_buffer,
                "hybrid": by_key[(ranks, "odc-hybrid")]["total_bytes"],
                "state_flat": odc["state_bytes"],
                "gathered": odc["gathered_bytes"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--odc", default=shutil.which("odc") or str(REPO / "build/cmake/odc"))
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory for the marks")
    args = parser.parse_args()
    capacity = args.gpu_gb * 1e9

    def cell(value: float) -> str:
        return f"{value / 1e9:.1f}" + ("" if value <= capacity else " (over)")

    print(
        "| model | GPUs | FSDP2 | FSDP2, sync deferred | flat ODC, node cache off "
        "| flat ODC, node schemes at default budgets | flat ODC, node schemes sized to the model "
        "| hybrid ODC |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, model_args in MODELS:
        for row in rows(simulate(args.odc, model_args)):
            print(
                f"| {name} | {row['ranks']} | {cell(row['fsdp2'])} | {cell(row['fsdp2_deferred'])} "
                f"| {cell(row['flat'])} | {cell(row['flat_default'])} | {cell(row['flat_sized'])} "
                f"| {cell(row['hybrid'])} |"
            )
    print(
        f"\nGB per GPU (1e9 bytes), activations excluded; '(over)' marks more than {args.gpu_gb:g} "
        "GB before any activation."
    )


if __name__ == "__main__":
    main()
