#!/usr/bin/env bash
# The streamed scheme over NVSHMEM (issue #27) on the GPUs there are, several ranks per GPU:
# memory per process before (OLD libraries: the staged scheme) and after (NEW: streamed, folded
# on the device), exact sums with delays at 2 and 4 ranks in fp32 and bf16 with the default and a
# tiny staging budget (rings wrap, senders wait for credit), 1,000 minibatches, a rank killed
# mid-minibatch, the deterministic (pulled) scheme, odc.torch's FSDP2 training (its all-gather
# and reduce-scatter streams: folds from two streams at once) over NVSHMEM against a reference
# model, and the CUDA transport's sums unchanged.
# Correctness, memory and counters only: with ranks sharing a GPU, no timings.
# Usage (repository root on the GPU machine): dev/gpu/streamed_one_gpu.sh NEW OLD
#   NEW, OLD: folders with libodc.so and libodc_nvshmem.so (CUDA build), python/ and tests/.
# Output: $OUT/streamed.log
set -uo pipefail
new=${1:?usage: $0 NEW OLD}
old=${2:?usage: $0 NEW OLD}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH=${nvshmem_dir:+$nvshmem_dir/lib:}${LD_LIBRARY_PATH:-}
log="${OUT:-/tmp}/streamed.log"
status=0
source "$(dirname "$0")/stage.sh"
check="$(dirname "$0")/streamed_one_gpu.py"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
libs() {  # libs SNAPSHOT: the environment that selects it
  echo "PYTHONPATH=$1/python:$1/tests/gpu:$1/tests/python ODC_LIBRARY=$1/libodc.so ODC_NVSHMEM_PLUGIN=$1/libodc_nvshmem.so"
}
nodes1="ODC_TRANSPORT=nvshmem ODC_LOCAL_WORLD_SIZE=1"  # every rank its own pretended node
for world in 2 4; do
  stage "memory-old-$world" 300 env $(libs "$old") $nodes1 python3 "$check" memory "$world" 256
  stage "memory-new-$world" 300 env $(libs "$new") $nodes1 python3 "$check" memory "$world" 256
done
for direct in 0 1; do
  for world in 2 4; do
    for dtype in float32 bfloat16; do
      stage "sums-direct$direct-$world-$dtype" 300 env $(libs "$new") $nodes1 \
        ODC_NVSHMEM_DIRECT=$direct python3 "$check" sums "$world" "$dtype" 6
      stage "sums-tiny-direct$direct-$world-$dtype" 300 env $(libs "$new") $nodes1 \
        ODC_NVSHMEM_DIRECT=$direct ODC_STAGING_BYTES=256K python3 "$check" sums "$world" "$dtype" 6
    done
  done
done
stage "thousand" 500 env $(libs "$new") $nodes1 ODC_STAGING_BYTES=64K \
  python3 "$check" sums 2 float32 1000 1024
for world in 2 4; do
  stage "inside-$world" 300 env $(libs "$new") $nodes1 python3 "$check" inside "$world"
done
stage "dies" 200 env $(libs "$new") $nodes1 python3 "$check" dies
stage "deterministic" 300 env $(libs "$new") $nodes1 python3 "$check" deterministic
for ranks in 2 4; do
  stage "torch-nvshmem-$ranks" 300 env $(libs "$new") $nodes1 OMP_NUM_THREADS=2 python3 -c "
from test_torch_fsdp2_frozen import check_frozen_unused_and_adapter_parameters as check
check($ranks, 'cuda', tolerance=1e-4)
print('odc.torch over NVSHMEM (streamed): frozen, unused and adapter parameters ok on $ranks ranks')"
done
stage "cuda-sums" 300 env $(libs "$new") ODC_TRANSPORT=cuda python3 "$check" sums 2 bfloat16 6
exit $status
