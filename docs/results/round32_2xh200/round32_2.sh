#!/usr/bin/env bash
# Call 2 (2 x H200): the streamed staging's puts on a send lane of their own, with two outbox slots
# (lane), against main (cc98e3a), NVSHMEM streamed pushes between 2 pretended nodes of 1 GPU,
# alternated three times; then the NVSHMEM suite's nodes2 shard on the lane build, again with
# signals sent as puts (ODC_NVSHMEM_SIGNAL_PUT=1: the lane's own outbox part), and the rest of
# the non-direct shards.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NV=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
L=$OUT/bench2.log; date -u > $L; nvidia-smi -L >> $L
for r in 1 2 3; do
  for b in m2 lane; do
    echo "=== nvshmem $b round $r $(date -u +%T)" >> $L
    LD_LIBRARY_PATH=build/snap_$b:$LD_LIBRARY_PATH ODC_NVSHMEM_PLUGIN=build/snap_$b/libodc_nvshmem.so \
      ODC_LOCAL_WORLD_SIZE=1 timeout 110 build/snap_$b/odc_bench --transport nvshmem 4 512 >> $L 2>&1
    echo "rc $?" >> $L
  done
done
date -u >> $L
T=$OUT/suite2.log; date -u > $T
OUT=$OUT/s4 timeout 170 dev/gpu/run.sh gpu-suite-4 --snapshot build/snap_lane >> $T 2>&1; echo "gpu-suite-4 rc $?" >> $T
cat $OUT/s4/*.log >> $T 2>/dev/null; rm -rf $OUT/s4
ODC_NVSHMEM_SIGNAL_PUT=1 OUT=$OUT/s4p timeout 170 dev/gpu/run.sh gpu-suite-4 --snapshot build/snap_lane >> $T 2>&1; echo "gpu-suite-4 signal-put rc $?" >> $T
cat $OUT/s4p/*.log >> $T 2>/dev/null; rm -rf $OUT/s4p
OUT=$OUT/s5 timeout 200 dev/gpu/run.sh gpu-suite-5 --snapshot build/snap_lane >> $T 2>&1; echo "gpu-suite-5 rc $?" >> $T
cat $OUT/s5/*.log >> $T 2>/dev/null; rm -rf $OUT/s5
date -u >> $T
