#!/usr/bin/env bash
# odc_bench on the CUDA transport, two builds alternated (OLD, NEW: folders with odc_bench and
# its libodc.so), ROUNDS times each, one process per GPU; sizes MIN..MAX MiB; ORDER "old new"
# (default) or "new old" (which build runs first in a round: to see an order effect).
# Usage: dev/gpu/odc_bench_before_after.sh NEW OLD [ROUNDS=2] [MIN=1] [MAX=256] [ORDER]
# Output: $OUT/bench_<build>_<round>.txt and $OUT/bench.log
set -uo pipefail
new=${1:?usage: $0 NEW OLD [ROUNDS] [MIN] [MAX]}
old=${2:?usage: $0 NEW OLD [ROUNDS] [MIN] [MAX]}
rounds=${3:-2}
min=${4:-1}
max=${5:-256}
order=${6:-old new}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl_dir=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
log="${OUT:-/tmp}/bench.log"
status=0
source "$(dirname "$0")/stage.sh"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
for round in $(seq "$rounds"); do
  for build in $order; do
    dir=$old
    [ "$build" = new ] && dir=$new
    stage "$build-$round" 280 bash -c "LD_LIBRARY_PATH=$dir:${nccl_dir:+$nccl_dir/lib} \
      $dir/odc_bench $min $max > ${OUT:-/tmp}/bench_${build}_${round}.txt 2>&1"
  done
done
exit $status
