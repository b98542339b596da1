#!/usr/bin/env bash
# Call 3 (2 x H200): odc.train 1.5b over NVSHMEM on 2 pretended nodes of 1 (nvshmem-flat), main
# (m2) and the send lane (lane), alternated twice: the training step and its memory, not only
# odc_bench (issue #47: no regression in training step time).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
T=$OUT/train3.log; date -u > $T; nvidia-smi -L >> $T
for b in m2 lane m2 lane; do
  echo "=== $b $(date -u +%T)" >> $T
  NVTRAIN_STEPS=6 NVTRAIN_ARMS=nvshmem-flat OUT=$OUT/t_$b timeout 140 dev/gpu/run.sh nvshmem-train \
    --snapshot build/snap_$b >> $T 2>&1; echo "rc $?" >> $T
  cat $OUT/t_$b/nvshmem_train/nvshmem_train.txt >> $T 2>/dev/null
  tail -3 $OUT/t_$b/nvshmem_train/nvshmem-flat.stderr >> $T 2>/dev/null
  rm -rf $OUT/t_$b
done
date -u >> $T
