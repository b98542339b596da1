#!/usr/bin/env bash
# Session 2026-11-29b, call 1 (2 x H200): NVSHMEM streamed pushes before/after folds beside the sends
# (old = main 98b823b, new = folds beside, new16 = the same with 16-block fold clusters), alternated;
# CUDA odc_bench on 2 GPUs old/new (its new link columns); the NVSHMEM suite's nodes2 shard on new.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2; do
  for b in old new new16 ; do
    d=build/$([ $b = old ] && echo snap_old || echo snap_$b)
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=$d/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 \
      timeout 120 $d/odc_bench --transport nvshmem 4 256 >> $L 2>&1; echo "rc $?" >> $L
  done
done
for b in old new; do
  d=build/$([ $b = old ] && echo snap_old || echo snap_$b)
  echo "=== cuda 2 GPUs $b $(date -u +%T)" >> $L
  LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH timeout 150 $d/odc_bench 1 1024 >> $L 2>&1; echo "rc $?" >> $L
done
T=$OUT/suite.log; date -u > $T
OUT=$OUT/suite timeout 330 dev/gpu/run.sh gpu-suite-4 --snapshot build/snap_new >> $T 2>&1; echo "rc $?" >> $T
cat $OUT/suite/*.log >> $T 2>/dev/null; rm -rf $OUT/suite
date -u >> $T
