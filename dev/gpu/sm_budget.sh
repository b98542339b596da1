#!/usr/bin/env bash
# Does the SM budget of odc's data kernels (ODC_CUDA_SMS) cost or win training speed?
# Issue #14's balanced control ran ODC's 8,192-token microbatches 5% slower than FSDP2's NCCL ones
# (0.39-0.40 s vs 0.374 s): odc's gather and push kernels size their grids for every SM (2 blocks
# per SM), so while one overlaps a layer's compute it can hold SMs the compute kernels wait for.
# 1. odc_bench 16..256 MiB on 4 GPUs with all SMs, 32 and 16 (what the copies alone lose);
# 2. odc.train 1.5b, balanced (--constant-length 8192), 4 samples per rank, 4 measured
#    minibatches: collective + lb-micro, and odc + lb-mini with all SMs / 32 / 16, twice each,
#    interleaved (drift shows as the two collective runs differing).
# Output: $OUT/sm_budget/sm_budget.log and the results JSON files. Expected run time ~5 min.
set -uo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so ODC_CLI=$PWD/.device/odc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.device${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dest="$OUT/sm_budget"
mkdir -p "$dest"
exec > >(tee "$dest/sm_budget.log") 2>&1
budget=${SM_BUDGET_SECONDS:-540}
step() {  # step NAME SECONDS COMMAND...: runs it under timeout, logs rc and time, never stops
  local name=$1 start=$SECONDS rc=0 left=$((budget - SECONDS))
  local limit=$(($2 < left ? $2 : left))
  if [ "$limit" -lt 15 ]; then echo "== $name: SKIPPED (time budget spent)"; return 0; fi
  shift 2
  echo "== $name (limit $limit s)"
  timeout -k 5 "$limit" "$@" || rc=$?
  echo "-- $name: rc=$rc in $((SECONDS - start)) s"
}
date -u
git log -1 --oneline || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | head -4

step "odc_bench sms=all" 45 .device/odc_bench --transport cuda 16 256 4
for sms in 32 16; do
  step "odc_bench sms=$sms" 45 env ODC_CUDA_SMS=$sms .device/odc_bench --transport cuda 16 256 4
done

cost=3.123e-05,1.187e-09,0.07082  # the 1.5b fit (docs/benchmarks.md, issue #7)
train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train --preset 1.5b
  --samples-per-rank 4 --cost "$cost" --lengths data/longalign_like.txt --constant-length 8192
  --steps 4 --timeline "")
for round in 1 2; do
  step "collective round $round" 60 "${train[@]}" --comm collective --policy lb-micro \
    --output "$dest/collective_$round.json"
  for sms in all 32 16; do
    if [ "$sms" = all ]; then
      step "odc sms=all round $round" 60 "${train[@]}" --comm odc --policy lb-mini \
        --output "$dest/odc_all_$round.json"
    else
      step "odc sms=$sms round $round" 60 env ODC_CUDA_SMS=$sms "${train[@]}" --comm odc \
        --policy lb-mini --output "$dest/odc_${sms}_$round.json"
    fi
  done
done

python3 - "$dest" <<'PY'
import json, statistics, sys
from pathlib import Path
dest = Path(sys.argv[1])
rows = {}
for path in sorted(dest.glob("*.json")):
    name = path.stem.rsplit("_", 1)[0]
    (run,) = json.loads(path.read_text())
    durations = [e - b for rank in run["timeline"] for (b, e, _) in rank]
    rows.setdefault(name, []).append((run["samples_per_second"], statistics.mean(durations),
                                      run["peak_memory_bytes"] / 2**30))
base = statistics.mean(r[0] for r in rows.get("collective", [(float("nan"),)]))
print(f"{'run':12s} {'samples/s (each)':>22s} {'vs collective':>14s} {'microbatch s':>13s} {'peak GiB':>9s}")
for name, values in rows.items():
    sps = [v[0] for v in values]
    print(f"{name:12s} {' '.join(f'{x:.2f}' for x in sps):>22s} "
          f"{statistics.mean(sps) / base:13.3f}x {statistics.mean(v[1] for v in values):13.3f} "
          f"{max(v[2] for v in values):9.2f}")
PY
date -u
