#!/usr/bin/env bash
# Issue #14 (split the outliers) on the 4-GPU machine, from the repository root:
#   1. tests/gpu/test_train_split_gpu.py: a split sample (NCCL subgroup K/V all-gather, varlen
#      flash attention under the global causal mask) equals the whole sample in bf16 (~45 s);
#   2. odc.train --compare --split auto, 1.5b, 4 samples per rank, cost model given (the fit
#      recorded in docs/benchmarks.md, so no calibration): collective + LB-Micro,
#      collective + LB-Micro + split, ODC + LB-Mini + split on
#      heavy-tailed data (8 measured minibatches, ~2 min), LongAlign-like (3, ~2 min) and
#      --constant-length 8192 (2, ~1.2 min), each with its timeline.
# Expected total: ~6 minutes (each stage has a timeout; the timeouts sum to 8 minutes).
# Output: $OUT/issue14/issue14.log and $OUT/issue14/issue14.tgz (results JSON + timelines PNG).
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="$OUT/issue14"
work=$(mktemp -d)
mkdir -p "$out"
log="$out/issue14.log"
cost=3.123e-05,1.187e-09,0.07082  # docs/benchmarks.md: the 1.5b fit on this machine
status=0

stage() {  # stage NAME TIMEOUT COMMAND...: runs it, logs it, keeps going on failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S)): $*" | tee -a "$log"
  local rc=0
  # timeout signals its whole process group, so odc.launch's rank processes go too.
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== $name FAILED (exit $rc)" | tee -a "$log"
    status=1
  fi
}

{
  echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
  echo "date: $(date -u)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >>"$log"

stage gpu-test 75 python3 -m pytest -q -rs tests/gpu/test_train_split_gpu.py

# The planner's prediction over the whole file, for the record next to the measurement.
stage predict-heavy 15 .device/odc compare --lengths data/heavy_tailed.txt --ranks 4 \
  --minibatch-size 16 --max-tokens 65536 --cost "$cost" --split auto
stage heavy-tailed 160 python3 -m odc.train --lengths data/heavy_tailed.txt --preset 1.5b \
  --ranks 4 --samples-per-rank 4 --compare --split auto --steps 8 --cost "$cost" \
  --output "$work/heavy_tailed.json" --timeline "$work/heavy_tailed.png"
stage longalign 150 python3 -m odc.train --lengths data/longalign_like.txt --max-length 65536 \
  --preset 1.5b --ranks 4 --samples-per-rank 4 --compare --split auto --steps 3 --cost "$cost" \
  --output "$work/longalign.json" --timeline "$work/longalign.png"
stage constant 80 python3 -m odc.train --lengths data/longalign_like.txt --constant-length 8192 \
  --preset 1.5b --ranks 4 --samples-per-rank 4 --compare --split auto --steps 2 --cost "$cost" \
  --output "$work/constant.json" --timeline "$work/constant.png"

tar -czf "$out/issue14.tgz" -C "$work" . 2>>"$log" || status=1
echo "=== done ($(date -u +%H:%M:%S)), status $status" | tee -a "$log"
exit $status
