#!/usr/bin/env bash
# The CUDA transport before (OLD) and after (NEW) a change on one GPU, two ranks on it,
# alternating builds three times each (dev/gpu/cuda_transport_timing_one_gpu.py says what the
# numbers are and are not). Usage: dev/gpu/cuda_transport_timing_one_gpu.sh NEW OLD
# Output: $OUT/cuda_timing.log
set -uo pipefail
new=${1:?usage: $0 NEW OLD}
old=${2:?usage: $0 NEW OLD}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/cuda_timing.log"
status=0
source "$(dirname "$0")/stage.sh"
check="$(dirname "$0")/cuda_transport_timing_one_gpu.py"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
for round in 1 2 3; do
  for build in old new; do
    dir=$old
    [ "$build" = new ] && dir=$new
    stage "$build-$round" 300 env PYTHONPATH="$dir/python" ODC_LIBRARY="$dir/libodc.so" \
      python3 "$check" "$build"
  done
done
exit $status
