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
# Runs "$@" (stderr merged into stdout) and, whenever it has printed nothing for 7 s, says so:
# no phase stays silent for more than 10 s (a long compile, pip's install, torch's import, a rank
# building its model). The watcher checks once a second; its lines start with "   ...".
with_heartbeat() {
  local label=$1
  shift
  local last_line
  last_line=$(mktemp)
  (
    while sleep 1; do
      [[ -e "$last_line" ]] || exit 0
      quiet=$(($(date +%s) - $(stat -c %Y "$last_line")))
      if ((quiet >= 7)); then
        echo "   ... $label: still working (${quiet} s since its last line)"
        touch "$last_line"
      fi
    done
  ) &
  local watcher=$!
  local status=0
  "$@" 2>&1 | while IFS= read -r line || [[ -n "$line" ]]; do
    printf '%s\n' "$line"
    touch "$last_line"
  done || status=${PIPESTATUS[0]}
  kill "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  rm -f "$last_line"
  return "$status"
}

phase "setup: Debian packages and the Python environment (.venv)"
with_heartbeat setup scripts/setup.sh
phase "build: C++ library, odc tool and tests (CMake), then the Python package"
with_heartbeat build scripts/build.sh

run_dir="runs/$(date -u +%Y%m%d-%H%M%S)"
suffix=1
while [[ -e "$run_dir" ]]; do run_dir="runs/$(date -u +%Y%m%d-%H%M%S)-$((++suffix))"; done
mkdir -p "$run_dir"

cost_7b="0.00027401178,0.0000000042464424,0"
for dataset in longalign_like swe_smith_like aime_rl_like; do
  phase "planner, data/$dataset.txt: 8 ranks, 32 samples per minibatch, max 65536 tokens, 7B cost"
  with_heartbeat "odc compare" .venv/bin/odc compare --lengths "data/$dataset.txt" --ranks 8 \
    --samples-per-rank 4 --max-tokens 65536 --cost "$cost_7b" --plot "$run_dir/planner_$dataset.png"
done
echo
echo "Bubble: the share of GPU time spent idle, waiting for other ranks. Collective FSDP waits at"
echo "every layer of every microbatch; ODC once per minibatch. The figures show the same per policy."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo
echo "Looking for GPUs (importing torch)"
if with_heartbeat "torch import" .venv/bin/python -c \
  "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
  phase "python -m odc.train: all GPUs, 1.5b preset, LongAlign-like lengths (up to 64K)"
  with_heartbeat "odc.train" .venv/bin/python -u -m odc.train --lengths data/longalign_like.txt \
    --max-length 65536 --compare --run-dir "$run_dir"
else
  phase "python -m odc.train: no GPUs: tiny preset, 4 CPU processes, LongAlign-like lengths / 128"
  echo "   (CPU processes share this machine's cores: the run shows the mechanics and that both"
  echo "    modes train alike, not GPU speed; GPU results: docs/benchmarks.md)"
  with_heartbeat "odc.train" .venv/bin/python -u -m odc.train --lengths data/longalign_like.txt \
    --device cpu --ranks 4 --preset tiny --length-scale 0.0078125 --steps 3 --compare \
    --run-dir "$run_dir"
fi
phase "done: everything this run wrote is in $run_dir/"
ls -1 "$run_dir"
