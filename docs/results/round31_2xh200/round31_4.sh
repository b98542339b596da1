#!/usr/bin/env bash
# Call 4 (2 x H200): odc.torch's slots marked by the group's post_backward instead of a hook per
# unsharded parameter, and the placeholder keeper skipped by the direct push (after) against main
# (before); odc arm, 2 ranks, 1.5b compiled, host time attributed (--attribute), alternated.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/host_attribute.log; date -u > $L; nvidia-smi -L >> $L
for v in before after before after; do
  py=python; [ $v = before ] && py=build/snap_main/python
  echo "=== $v $(date -u +%T)" >> $L
  PYTHONPATH=$PWD/$py ODC_LIBRARY=$PWD/build/snap_main/libodc.so ODC_CLI=$PWD/build/snap_main/odc \
    timeout 120 python3 dev/gpu/host_floor.py --preset 1.5b --tokens 512,2048 --microbatches 4 \
    --minibatches 2 --compile on --arms odc --attribute >> $L 2>&1; echo "rc $?" >> $L
done
date -u >> $L
