#!/usr/bin/env bash
# Issue #28 on one GPU: odc.torch's FSDP2-migration behaviour with CUDA models (2 ranks share
# the GPU), the default collectives check's cost on NCCL, and `python -m odc.fit` (fit_one_gpu.sh).
# Usage (repository root on the GPU machine): dev/gpu/torch_migration_one_gpu.sh SNAPSHOT
#   SNAPSHOT: a folder with libodc.so and python/ of the tree under test.
# Output: $OUT/torch_migration.log (and fit_one_gpu.sh's files).
set -uo pipefail
snapshot=$1
export PYTHONPATH=$snapshot/python ODC_LIBRARY=$snapshot/libodc.so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
log="$out/torch_migration.log"
status=0
source "$(dirname "$0")/stage.sh"
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; } >>"$log" 2>&1
for name in migration failure check-cost; do
  stage "$name" 240 python3 dev/gpu/torch_migration_one_gpu.py "$name"
done
[ "${SKIP_FIT:-0}" = 1 ] || dev/gpu/fit_one_gpu.sh "$snapshot" || status=1  # SKIP_FIT=1: the odc.torch stages only
exit $status
