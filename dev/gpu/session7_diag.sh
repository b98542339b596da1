#!/usr/bin/env bash
# Session 7, diagnosis for issue #14: where ODC + LB-Mini + split loses against its prediction.
# ODC runs only (the collective baselines are in docs/benchmarks.md, sixth round), 1.5b, 4
# samples per rank, the 1.5b cost fit given, each with the full microbatch log (per microbatch:
# GPU seconds, host enqueue seconds, what it held) and a torch.profiler trace of the last
# minibatch run again (--profile):
#   heavy      heavy-tailed, 10 minibatches (~1.5 min)
#   longalign  LongAlign-like <= 64K, 10 minibatches (~2 min)
# Output: $OUT/session7_diag/{session7_diag.log, session7_diag.tgz}.
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4
out="$OUT/session7_diag"
work=$(mktemp -d)
mkdir -p "$out"
log="$out/session7_diag.log"
cost=3.123e-05,1.187e-09,0.07082
status=0
source "$(dirname "$0")/stage.sh"  # stage NAME TIMEOUT COMMAND...
echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l); date: $(date -u)" >>"$log"
wants() { [[ " $STAGES " == *" $1 "* ]]; }
STAGES="$*"
train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train
  --preset 1.5b --samples-per-rank 4 --cost "$cost" --comm odc --policy lb-mini --split auto
  ${ODC_TRAIN_EXTRA:-})
if wants heavy; then
  stage heavy 200 "${train[@]}" --lengths data/heavy_tailed.txt --steps 10 \
    --profile "$work/profile_heavy" --output "$work/heavy.json" --timeline ""
fi
if wants longalign; then
  stage longalign 240 "${train[@]}" --lengths data/longalign_like.txt --max-length 65536 \
    --steps 10 --output "$work/longalign.json" --timeline ""
fi
for f in "$work"/*.json; do
  [ -e "$f" ] && python3 dev/analysis/microbatch_fit.py "$f" >>"$log" 2>&1 || true
done
tar -czf "$out/session7_diag.tgz" -C "$work" . 2>>"$log" || status=1
echo "=== done ($(date -u +%H:%M:%S)), status $status" | tee -a "$log"
exit $status
