#!/usr/bin/env bash
# The core's node schemes (issue #27 item 4) on one GPU, several ranks on it, pretended nodes:
# node-aggregated pushes over NVSHMEM (2 nodes of 2, every rank its own node; a tiny staging
# budget so rings wrap), and the node cache:
# NVSHMEM (its calls and direct NVLink loads; 2 nodes of 2, every rank its own node, one node,
# cache off, a late fetch), the CUDA transport on pretended nodes (the same core scheme over its
# kernels), odc.torch's FSDP2 over NVSHMEM with every rank its own node (its parameters served
# from the cache), memory with and without the cache, and the streamed sums unchanged.
# Correctness, bytes and memory only: with ranks sharing a GPU, no timings.
# Usage (repository root on the GPU machine): dev/gpu/node_cache_one_gpu.sh NEW
#   NEW: a folder with libodc.so and libodc_nvshmem.so (CUDA build), python/ and tests/.
# Output: $OUT/node_cache.log
set -uo pipefail
new=${1:?usage: $0 NEW}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH=${nvshmem_dir:+$nvshmem_dir/lib:}${LD_LIBRARY_PATH:-}
log="${OUT:-/tmp}/node_cache.log"
status=0
source "$(dirname "$0")/stage.sh"
check="$(dirname "$0")/node_cache_one_gpu.py"
streamed="$(dirname "$0")/streamed_one_gpu.py"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
libs="PYTHONPATH=$new/python:$new/tests/gpu:$new/tests/python ODC_LIBRARY=$new/libodc.so ODC_NVSHMEM_PLUGIN=$new/libodc_nvshmem.so"
nv="ODC_TRANSPORT=nvshmem"
for direct in 1 0; do
  stage "nvshmem-nodes2-direct$direct" 400 env $libs $nv ODC_NVSHMEM_DIRECT=$direct \
    ODC_LOCAL_WORLD_SIZE=2 python3 "$check" windows 4 2 12 1
done
for world in 2 4; do
  stage "nvshmem-nodes1-$world" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=1 \
    python3 "$check" windows "$world" 1 12 1
done
stage "nvshmem-one-node" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=4 python3 "$check" windows 4 4 8 1
stage "nvshmem-nodes2-cache-off" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=2 ODC_NODE_CACHE_BYTES=0 \
  python3 "$check" windows 4 2 8 1
stage "nvshmem-nodes2-late-fetch" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=2 \
  ODC_NVSHMEM_TEST_FETCH_DELAY_US=20000 python3 "$check" windows 4 2 8 0
stage "cuda-nodes2" 400 env $libs ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
  python3 "$check" windows 4 2 12 1
stage "cuda-nodes2-late" 400 env $libs ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
  python3 "$check" windows 4 2 8 0
for shape in "4 2" "4 1" "2 1"; do
  stage "nvshmem-aggregation-${shape// /x}" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=${shape#* } \
    python3 "$check" aggregation $shape
done
stage "nvshmem-aggregation-tiny-staging" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=2 \
  ODC_STAGING_BYTES=256K python3 "$check" aggregation 4 2
stage "nvshmem-aggregation-relayed-and-direct" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=2 \
  ODC_STAGING_BYTES=256K ODC_NODE_AGGREGATION_BYTES=300000 python3 "$check" aggregation-mixed 4
for cache in default 0; do
  knob=""
  [ "$cache" = 0 ] && knob="ODC_NODE_CACHE_BYTES=0"
  stage "memory-cuda-nodes2-cache-$cache" 300 env $libs ODC_TRANSPORT=cuda ODC_LOCAL_WORLD_SIZE=2 \
    $knob python3 "$check" memory 4 64
done
for ranks in 2 4; do
  stage "torch-nvshmem-nodes1-$ranks" 400 env $libs $nv ODC_LOCAL_WORLD_SIZE=1 OMP_NUM_THREADS=2 \
    python3 -c "
from test_torch_fsdp2_frozen import check_frozen_unused_and_adapter_parameters as check
check($ranks, 'cuda', tolerance=1e-4)
print('odc.torch over NVSHMEM, every rank its own node (node cache): ok on $ranks ranks')"
done
stage "streamed-sums-nvshmem" 300 env $libs $nv ODC_LOCAL_WORLD_SIZE=1 \
  python3 "$streamed" sums 4 bfloat16 6
stage "streamed-dies" 200 env $libs $nv ODC_LOCAL_WORLD_SIZE=1 python3 "$streamed" dies
stage "cuda-sums" 300 env $libs ODC_TRANSPORT=cuda python3 "$streamed" sums 2 bfloat16 6
exit $status
