#!/usr/bin/env bash
# Issue #14 (split the outliers) on the 4-GPU machine, from the repository root:
#   1. tests/gpu/test_train_split_gpu.py: a split sample (NCCL subgroup K/V all-gather, varlen
#      flash attention under the global causal mask) equals the whole sample in bf16 (tiny and
#      0.5b presets, ~90 s: the first run's 75 s passed tiny and timed out in 0.5b);
#   2. odc.train, 1.5b, 4 samples per rank, cost model given (the fit recorded in
#      docs/benchmarks.md, so no calibration), with timelines: heavy-tailed data, --compare
#      --split auto (collective + LB-Micro, collective + LB-Micro + split, ODC + LB-Mini + split;
#      8 measured minibatches, ~1.7 min); LongAlign-like, collective + LB-Micro and ODC + LB-Mini +
#      split (6 minibatches, ~1.9 min); --constant-length 8192, the same two (2, ~0.8 min);
#   3. a summary of the ratios at the end of the log.
# Expected total: ~5.5 minutes; stage timeouts sum to 8 minutes (first run, at 45b902d with
# 3-run LongAlign and constant stages: 6.5 minutes).
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

stage gpu-test 110 python3 -m pytest -q -rs tests/gpu/test_train_split_gpu.py

# The planner's prediction over the whole file, for the record next to the measurement.
stage predict-heavy 10 .device/odc compare --lengths data/heavy_tailed.txt --ranks 4 \
  --minibatch-size 16 --max-tokens 65536 --cost "$cost" --split auto
common=(--preset 1.5b --ranks 4 --samples-per-rank 4 --cost "$cost")
stage heavy-tailed 130 python3 -m odc.train --lengths data/heavy_tailed.txt "${common[@]}" \
  --compare --split auto --steps 8 --output "$work/heavy_tailed.json" \
  --timeline "$work/heavy_tailed.png"
# LongAlign-like and balanced: the two runs the targets compare, one command each.
longalign=(--lengths data/longalign_like.txt --max-length 65536 --steps 6)
stage longalign-collective 80 python3 -m odc.train "${longalign[@]}" "${common[@]}" \
  --comm collective --policy lb-micro --output "$work/longalign_collective.json" \
  --timeline "$work/longalign_collective.png"
stage longalign-odc-split 70 python3 -m odc.train "${longalign[@]}" "${common[@]}" \
  --comm odc --policy lb-mini --split auto --output "$work/longalign_odc_split.json" \
  --timeline "$work/longalign_odc_split.png"
constant=(--lengths data/longalign_like.txt --constant-length 8192 --steps 2)
stage constant-collective 40 python3 -m odc.train "${constant[@]}" "${common[@]}" \
  --comm collective --policy lb-micro --output "$work/constant_collective.json" --timeline ""
stage constant-odc-split 40 python3 -m odc.train "${constant[@]}" "${common[@]}" \
  --comm odc --policy lb-mini --split auto --output "$work/constant_odc_split.json" \
  --timeline ""

# Ratios against collective + LB-Micro (samples/s), measured bubbles, split samples.
python3 - "$work" >>"$log" 2>&1 <<'PY' || status=1
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
def runs(*names):
    out = []
    for name in names:
        path = work / f"{name}.json"
        out += json.loads(path.read_text()) if path.exists() else []
    return out
for label, results in [
    ("heavy-tailed", runs("heavy_tailed")),
    ("longalign", runs("longalign_collective", "longalign_odc_split")),
    ("constant 8192", runs("constant_collective", "constant_odc_split")),
]:
    if not results:
        print(f"{label}: no results")
        continue
    base = results[0]["samples_per_second"]
    for r in results:
        name = f"{r['comm']} + {r['policy']}" + (" + split" if r.get("split") == "auto" else "")
        print(f"{label:14} {name:32} {r['samples_per_second'] / base:5.2f}x  bubble "
              f"{100 * r['bubble']:5.1f}% (predicted {100 * r['predicted_bubble']:5.1f}%)  "
              f"split samples {r.get('split_samples', 0)}  losses {r['losses']}")
PY

tar -czf "$out/issue14.tgz" -C "$work" . 2>>"$log" || status=1
echo "=== done ($(date -u +%H:%M:%S)), status $status" | tee -a "$log"
exit $status
