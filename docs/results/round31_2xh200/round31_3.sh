#!/usr/bin/env bash
# Call 3 (2 x H200): the compiled blocks' checkpoint inside the compiled function (after) against
# main's (before: transformers 5.17 checkpoints around the compiled forward); FSDP2 and odc arms,
# 2 ranks, 1.5b, host time per microbatch, alternated.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/host_floor.log; date -u > $L; nvidia-smi -L >> $L
for v in before after before after; do
  py=python; [ $v = before ] && py=build/snap_main/python
  echo "=== $v $(date -u +%T)" >> $L
  PYTHONPATH=$PWD/$py ODC_LIBRARY=$PWD/build/snap_main/libodc.so ODC_CLI=$PWD/build/snap_main/odc \
    timeout 200 python3 dev/gpu/host_floor.py --preset 1.5b --tokens 512,2048 --microbatches 4 \
    --minibatches 2 --compile on >> $L 2>&1; echo "rc $?" >> $L
done
date -u >> $L
