#!/usr/bin/env bash
# Call 1 (2 x H200): the GPU suite's odc.torch / odc.train shard on main (cc98e3a), the final form
# of last session's odc.torch change (the direct push skips the placeholder keeper only while
# .grad is set), which had run on the CPU only.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T=$OUT/suite6.log; date -u > $T; nvidia-smi -L >> $T
OUT=$OUT/suite timeout 400 dev/gpu/run.sh gpu-suite-6 --snapshot build/snap_m2 >> $T 2>&1; echo "gpu-suite-6 rc $?" >> $T
cat $OUT/suite/*.log >> $T 2>/dev/null; rm -rf $OUT/suite
date -u >> $T
