#!/usr/bin/env bash
# Call 3 (2 x H200): the final build (folds beside, 16 MiB device payloads, clusters of 8) against
# main (old) and the same with clusters of 16 (c16), alternated, 2 rounds; then the NVSHMEM suite's
# nodes2 and remaining shards on the final build.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench3.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2; do
  for b in old final c16; do
    d=build/snap_$b
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=$d/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 \
      timeout 120 $d/odc_bench --transport nvshmem 1 512 >> $L 2>&1; echo "rc $?" >> $L
  done
done
date -u >> $L
T=$OUT/suite3.log; date -u > $T
for s in gpu-suite-4 gpu-suite-5; do
  OUT=$OUT/suite timeout 330 dev/gpu/run.sh $s --snapshot build/snap_final >> $T 2>&1; echo "$s rc $?" >> $T
  cat $OUT/suite/*.log >> $T 2>/dev/null; rm -rf $OUT/suite
done
date -u >> $T
