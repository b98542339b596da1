#!/usr/bin/env bash
# Deterministic mode (the pulled scheme, issue #27 item 2) and the staged scheme on one GPU with
# two ranks on it: the GPU suite's rank bodies (tests/gpu/test_cuda_comm.py) over the CUDA
# transport and over NVSHMEM (its get / put calls, two pretended one-rank "nodes"): exact integer
# sums after every minibatch with random host and device delays, and bitwise-identical
# non-integer sums across two runs with different delays. Correctness only, no timings.
# Usage (repository root on the GPU machine): dev/gpu/deterministic_one_gpu.sh SNAPSHOT
#   SNAPSHOT: a folder with libodc.so and libodc_nvshmem.so (CUDA build), python/ and tests/.
# Output: $OUT/deterministic.log
set -uo pipefail
snapshot=${1:?usage: $0 SNAPSHOT}
export PYTHONPATH=$snapshot/python:$snapshot/tests/gpu:$snapshot/tests/python
export ODC_LIBRARY=$snapshot/libodc.so ODC_NVSHMEM_PLUGIN=$snapshot/libodc_nvshmem.so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH=${nvshmem_dir:+$nvshmem_dir/lib:}${LD_LIBRARY_PATH:-}
log="${OUT:-/tmp}/deterministic.log"
status=0
source "$(dirname "$0")/stage.sh"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
check='
import odc, test_cuda_comm as suite
for deterministic in (True, False):
    done = odc.launch(suite._minibatch_rank, 2, 12, 65537, "bfloat16", True, deterministic,
                      timeout=300)
    assert done == [12, 12], done
    print("exact sums, deterministic" if deterministic else "exact sums, default scheme", done)
first = odc.launch(suite._deterministic_rank, 2, 1, 65537, timeout=300)
second = odc.launch(suite._deterministic_rank, 2, 2, 65537, timeout=300)
assert first == second, "deterministic sums differ between runs"
print("deterministic: bitwise identical across runs with different delays")
'
stage cuda 300 python3 -c "$check"
stage nvshmem-two-nodes 300 env ODC_TRANSPORT=nvshmem ODC_NVSHMEM_DIRECT=0 \
  ODC_LOCAL_WORLD_SIZE=1 ODC_NVSHMEM_HIERARCHICAL=1 python3 -c "$check"
exit $status
