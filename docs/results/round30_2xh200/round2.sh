#!/usr/bin/env bash
# Call 2 (2 x H200): NVSHMEM streamed pushes by chunk payload (4 / 8 / 16 MiB, fold clusters of 16)
# against folds beside with clusters of 8 (new) and main (old), alternated, 2 rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench2.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2; do
  for b in old new new16 c8 c16; do
    d=build/snap_$b
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=$d/libodc_nvshmem.so ODC_LOCAL_WORLD_SIZE=1 \
      timeout 120 $d/odc_bench --transport nvshmem 16 512 >> $L 2>&1; echo "rc $?" >> $L
  done
done
date -u >> $L
