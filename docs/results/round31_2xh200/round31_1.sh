#!/usr/bin/env bash
# Call 1 (2 x H200): main (the pass beside the sends per slot's worth of bytes, first run on a GPU)
# against a lab build whose pack copies no payload (the put still moves every byte; sums wrong by
# design): how much of a streamed push the pack costs. Then the NVSHMEM suite's nodes2 shard on main.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench1.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2; do
  for b in main nopack; do
    plugin=build/snap_$b/libodc_nvshmem.so
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=build/snap_main:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=$plugin ODC_LOCAL_WORLD_SIZE=1 \
      timeout 110 build/snap_main/odc_bench --transport nvshmem 4 512 >> $L 2>&1; echo "rc $?" >> $L
  done
done
date -u >> $L
T=$OUT/suite1.log; date -u > $T
OUT=$OUT/suite timeout 200 dev/gpu/run.sh gpu-suite-4 --snapshot build/snap_main >> $T 2>&1; echo "gpu-suite-4 rc $?" >> $T
cat $OUT/suite/*.log >> $T 2>/dev/null; rm -rf $OUT/suite
date -u >> $T
