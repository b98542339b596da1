#!/usr/bin/env bash
# Issue #14, third round on the 4-GPU machine, after (a) the garbage collector no longer runs
# inside measured minibatches (odc.train freezes what it built before the loop: every ODC run of
# sm_budget.sh had its last minibatch ~0.2 s long), (b) odc.train's ODC runs size odc's kernels
# for 32 SMs (ODC_CUDA_SMS; balanced microbatches 2% faster), (c) LB-Mini's microbatches within
# LB-Micro's largest (issue #17's default). Stages, chosen by the arguments (in this order):
#   bench     odc_bench 16..256 MiB, 4 GPUs, all SMs against ODC_CUDA_SMS=32 (~1.3 min);
#   constant  balanced --constant-length 8192, --compare --split auto, 8 minibatches (~1.7 min);
#   longalign LongAlign-like <= 64K, --compare --split auto, 10 minibatches (~4 min);
#   heavy     heavy-tailed, --compare --split auto, 10 minibatches (~2.5 min).
# odc.train under torchrun, 1.5b, 4 samples per rank, cost given (the 1.5b fit), 1 warm-up.
# ODC_TRAIN_EXTRA: more odc.train arguments for every run (e.g. --microbatch-memory cap).
# ODC_TRAIN_COST: the cost model (default the 1.5b fit below; "fit" calibrates, floor included).
# Output: $OUT/issue14_round3/issue14_round3.log and issue14_round3.tgz (results + timelines).
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4  # torchrun would set 1 (with a warning); the ranks' CPU work is small
out="$OUT/issue14_round3"
work=$(mktemp -d)
mkdir -p "$out"
log="$out/issue14_round3.log"
cost=${ODC_TRAIN_COST:-3.123e-05,1.187e-09,0.07082}  # docs/benchmarks.md: the 1.5b fit here
status=0

source "$(dirname "$0")/stage.sh"  # stage NAME TIMEOUT COMMAND...

{
  echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
  echo "date: $(date -u)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >>"$log"

wants() { [[ " $STAGES " == *" $1 "* ]]; }
STAGES="$*"
if wants bench; then
  nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
  export LD_LIBRARY_PATH=$PWD/.device${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  stage bench-all-sms 45 .device/odc_bench --transport cuda 16 256 4
  stage bench-32-sms 45 env ODC_CUDA_SMS=32 .device/odc_bench --transport cuda 16 256 4
fi
train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train
  --preset 1.5b --samples-per-rank 4 --cost "$cost" --compare --split auto ${ODC_TRAIN_EXTRA:-})
if wants constant; then
  stage constant 130 "${train[@]}" --lengths data/longalign_like.txt --constant-length 8192 \
    --steps 8 --output "$work/constant.json" --timeline ""
fi
if wants longalign; then
  stage longalign 400 "${train[@]}" --lengths data/longalign_like.txt --max-length 65536 \
    --steps 10 --output "$work/longalign.json" --timeline "$work/longalign.png"
fi
if wants heavy; then
  stage heavy-tailed 300 "${train[@]}" --lengths data/heavy_tailed.txt --steps 10 \
    --output "$work/heavy_tailed.json" --timeline "$work/heavy_tailed.png"
fi

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

for f in "$work"/*.json; do  # measured microbatches against the cost model (seventh round on)
  [ -e "$f" ] && python3 dev/analysis/microbatch_fit.py "$f" >"$f.fit.txt" 2>&1 || true
done
tar -czf "$out/issue14_round3.tgz" -C "$work" . 2>>"$log" || status=1
echo "=== done ($(date -u +%H:%M:%S)), status $status" | tee -a "$log"
exit $status
