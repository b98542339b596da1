#!/usr/bin/env bash
# Sixth round, second call (4 x H200): after the narrowing gather and the end of the .grad
# scratch, (1) the 1.5b --compare memory run of issue17_round3.sh (longalign_like at 64K, under
# torchrun, 3 measured minibatches); (2) issue #14's balanced stage (constant 8192, --compare
# --split auto, 8 minibatches) with torch's default AdamW and with --optimizer adamw-fused (the
# step is launched only after check_minibatch saw the minibatch end on the GPU, so its launch
# time is idle GPU time under ODC). Expected: ~6 minutes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
export OMP_NUM_THREADS=4
ROOT_OUT=$OUT
mkdir -p "$ROOT_OUT/memory"
WORK=$(mktemp -d)
(
  date -u
  timeout --kill-after=10 170 python3 -m torch.distributed.run --standalone --nproc_per_node 4 \
    -m odc.train --preset 1.5b --lengths data/longalign_like.txt --max-length 65536 --steps 3 \
    --samples-per-rank 4 --timeline "" --compare --cost 3.123e-05,1.187e-09,0.07082 \
    --output "$WORK/1.5b_compare_torchrun.json"
  echo "exit $?"
  python3 dev/gpu/issue17_memory_table.py "$WORK"/*.json
  cp "$WORK"/*.json "$ROOT_OUT/memory/" 2>/dev/null
) > "$ROOT_OUT/memory/memory_1.5b.log" 2>&1
tail -5 "$ROOT_OUT/memory/memory_1.5b.log"
OUT=$ROOT_OUT/adamw bash dev/gpu/issue14_round3.sh constant; tail -8 "$ROOT_OUT/adamw/issue14_round3/issue14_round3.log"
OUT=$ROOT_OUT/fused ODC_TRAIN_EXTRA="--optimizer adamw-fused" bash dev/gpu/issue14_round3.sh constant
tail -8 "$ROOT_OUT/fused/issue14_round3/issue14_round3.log"
date -u
