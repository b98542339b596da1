#!/usr/bin/env bash
# Call 4 (2 x H200): why FSDP2's arm slowed with the checkpoint inside the compiled blocks (round
# 31): its kernels per profiled microbatch (NCCL's by name, count and device ms) and its host
# time, with the checkpoint inside (--checkpoint-inside) and around the block (main), 2 ranks,
# 1.5b, 512 tokens, alternated.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/host_kernels.log; date -u > $L; nvidia-smi -L >> $L
for v in inside main; do
  extra=""; [ $v = inside ] && extra=--checkpoint-inside
  echo "=== $v $(date -u +%T)" >> $L
  PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/build/snap_lane/libodc.so ODC_CLI=$PWD/build/snap_lane/odc \
    timeout 200 python3 dev/gpu/host_floor.py --preset 1.5b --tokens 512 --microbatches 4 \
    --minibatches 2 --compile on --arms fsdp2 --attribute --kernels $extra >> $L 2>&1; echo "rc $?" >> $L
done
date -u >> $L
