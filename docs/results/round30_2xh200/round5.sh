#!/usr/bin/env bash
# Call 5 (2 x H200): the kept build (folds beside, 16 MiB payloads, 16-block clusters, no macros)
# against main, alternated; the NVSHMEM suite's nodes2 shard and the CUDA suite on it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench5.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2; do
  for b in old final; do
    d=build/snap_$b
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=$d/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 \
      timeout 120 $d/odc_bench --transport nvshmem 4 512 >> $L 2>&1; echo "rc $?" >> $L
  done
done
date -u >> $L
T=$OUT/suite5.log; date -u > $T
for s in gpu-suite-4 gpu-suite-1; do
  OUT=$OUT/suite timeout 280 dev/gpu/run.sh $s --snapshot build/snap_final >> $T 2>&1; echo "$s rc $?" >> $T
  cat $OUT/suite/*.log >> $T 2>/dev/null; rm -rf $OUT/suite
done
date -u >> $T
