#!/usr/bin/env bash
# The main job. 1) Setup and the one build (scripts/setup.sh, scripts/build.sh). 2) The planner's
# predicted bubble of each load-balancing policy on the three shipped datasets (8 ranks, 32
# samples per minibatch, 64K tokens, 7B cost model), with a figure. 3) `python -m odc.train`:
# collective FSDP2 + LB-Micro against ODC + LB-Mini on LongAlign-like lengths, measured: on all
# GPUs with the 1.5b preset where GPUs exist, else the tiny preset on 4 CPU processes with the
# lengths scaled down 128x. Everything it writes goes into a new runs/<UTC time>/ directory.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
started=$SECONDS
phase() { echo; echo "== [$((SECONDS - started)) s] $* =="; }

phase "setup: Debian packages and the Python environment (.venv)"
scripts/setup.sh
phase "build: C++ library, odc tool and tests (CMake), then the Python package"
scripts/build.sh

run_dir="runs/$(date -u +%Y%m%d-%H%M%S)"
suffix=1
while [[ -e "$run_dir" ]]; do run_dir="runs/$(date -u +%Y%m%d-%H%M%S)-$((++suffix))"; done
mkdir -p "$run_dir"

cost_7b="0.00027401178,0.0000000042464424,0"
for dataset in longalign_like swe_smith_like aime_rl_like; do
  phase "planner, data/$dataset.txt: 8 ranks, 32 samples per minibatch, max 65536 tokens, 7B cost"
  .venv/bin/odc compare --lengths "data/$dataset.txt" --ranks 8 --samples-per-rank 4 \
    --max-tokens 65536 --cost "$cost_7b" --plot "$run_dir/planner_$dataset.png"
done
echo
echo "Bubble: the share of GPU time spent idle, waiting for other ranks. Collective FSDP waits at"
echo "every layer of every microbatch; ODC once per minibatch. The figures show the same per policy."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
  phase "python -m odc.train: all GPUs, 1.5b preset, LongAlign-like lengths (up to 64K)"
  .venv/bin/python -m odc.train --lengths data/longalign_like.txt --max-length 65536 --compare \
    --run-dir "$run_dir"
else
  phase "python -m odc.train: no GPUs: tiny preset, 4 CPU processes, LongAlign-like lengths / 128"
  echo "   (CPU processes share this machine's cores: the run shows the mechanics and that both"
  echo "    modes train alike, not GPU speed; GPU results: docs/benchmarks.md)"
  .venv/bin/python -m odc.train --lengths data/longalign_like.txt --device cpu --ranks 4 \
    --preset tiny --length-scale 0.0078125 --steps 3 --compare --run-dir "$run_dir"
fi
phase "done: everything this run wrote is in $run_dir/"
ls -1 "$run_dir"
