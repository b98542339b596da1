#!/usr/bin/env bash
# Issue #14 (split the outliers) on the 4-GPU machine, from the repository root:
#   1. tests/gpu/test_train_split_gpu.py -k tiny: a split sample equals the whole sample in bf16
#      with K/V through the NCCL subgroup and through odc pulls (one launch, both; ~35 s; the
#      0.5b case of that file is left out for time);
#   2. odc.train under torchrun (the runs of one command share the rank processes, which saves
#      ~10 s of start-up per run against self-launch), 1.5b, 4 samples per rank, cost model given
#      (the fit recorded in docs/benchmarks.md, so no calibration), 1 warm-up minibatch each:
#      - heavy-tailed data, --compare --split auto --kv-exchange both: collective + LB-Micro,
#        collective + LB-Micro + split, ODC + LB-Mini + split with K/V through NCCL and through
#        odc; 10 measured minibatches (~2 min);
#      - balanced control --constant-length 8192, --compare --split auto (nothing is split, so
#        the two collective runs are the same configuration twice: their ratio is the noise),
#        6 minibatches (~1.1 min);
#      - LongAlign-like (<= 64K), --compare --split auto, 5 minibatches (~2 min; its first,
#        warm-up minibatch alone takes 10-13 s);
#   3. a summary: ratios against collective + LB-Micro, per-minibatch ratios, bubbles, and the
#      time every GPU idles at each minibatch's edges (lead-in, tail).
# Expected total: ~5.5 minutes (most important stages first); stage timeouts sum to 7.5 minutes.
# Output: $OUT/issue14/issue14.log and $OUT/issue14/issue14.tgz (results JSON + timelines PNG).
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4  # torchrun would set 1 (with a warning); the ranks' CPU work is small
out="$OUT/issue14"
work=$(mktemp -d)
mkdir -p "$out"
log="$out/issue14.log"
cost=3.123e-05,1.187e-09,0.07082  # docs/benchmarks.md: the 1.5b fit on this machine
status=0

source "$(dirname "$0")/stage.sh"  # stage NAME TIMEOUT COMMAND...

{
  echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
  echo "date: $(date -u)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >>"$log"

stage gpu-test 65 python3 -m pytest -q -rs tests/gpu/test_train_split_gpu.py -k tiny

# The planner's prediction over the whole file, for the record next to the measurement.
stage predict-heavy 10 .device/odc compare --lengths data/heavy_tailed.txt --ranks 4 \
  --minibatch-size 16 --max-tokens 65536 --cost "$cost" --split auto

train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train
  --preset 1.5b --samples-per-rank 4 --cost "$cost" --compare --split auto)
stage heavy-tailed 155 "${train[@]}" --lengths data/heavy_tailed.txt --steps 10 \
  --kv-exchange both --output "$work/heavy_tailed.json" --timeline "$work/heavy_tailed.png"
stage constant 80 "${train[@]}" --lengths data/longalign_like.txt --constant-length 8192 \
  --steps 6 --output "$work/constant.json" --timeline ""
stage longalign 140 "${train[@]}" --lengths data/longalign_like.txt --max-length 65536 \
  --steps 5 --output "$work/longalign.json" --timeline "$work/longalign.png"

# Ratios against collective + LB-Micro (samples/s), per-minibatch spread, measured bubbles,
# the GPUs' idle time at the minibatch edges, split samples.
python3 - "$work" >>"$log" 2>&1 <<'PY' || status=1
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
print("\n=== summary")
for label, name in [("heavy-tailed", "heavy_tailed"), ("constant 8192", "constant"),
                    ("longalign", "longalign")]:
    path = work / f"{name}.json"
    if not path.exists():
        print(f"{label}: no results")
        continue
    results = json.loads(path.read_text())
    base = results[0]
    for r in results:
        run = f"{r['comm']} + {r['policy']}"
        if r.get("split") == "auto":
            run += f" + split ({r.get('kv_exchange')})"
        each = [b / m for b, m in zip(base["minibatch_seconds"], r["minibatch_seconds"])]
        print(f"{label:13} {run:38} {r['samples_per_second'] / base['samples_per_second']:5.3f}x "
              f"(per minibatch {min(each):.2f}-{max(each):.2f}x over {len(each)})  bubble "
              f"{100 * r['bubble']:5.1f}% (predicted {100 * r['predicted_bubble']:5.1f}%)  "
              f"lead-in {1000 * r.get('lead_in_seconds', 0):5.1f} ms  tail "
              f"{1000 * r.get('tail_seconds', 0):5.1f} ms  step {r['step_seconds']:.3f} s  "
              f"split samples {r.get('split_samples', 0)}")
        print(f"{'':13}   spans {[round(s, 3) for s in r['minibatch_seconds']]}")
        print(f"{'':13}   losses {[round(x, 4) for x in r['losses']]}")
PY

tar -czf "$out/issue14.tgz" -C "$work" . 2>>"$log" || status=1
echo "=== done ($(date -u +%H:%M:%S)), status $status" | tee -a "$log"
exit $status
