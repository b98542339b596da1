#!/usr/bin/env bash
# odc.torch with frozen, unused and adapter parameters and a failing minibatch (issue #26) on the
# GPUs of one machine, several ranks per GPU (gloo carries FSDP2's few collectives, odc's CUDA
# transport the gathers and pushes): correctness only, no timings. Runs the CPU tests' bodies
# (tests/python/test_torch_fsdp2_frozen.py) with device "cuda" for 2 and 4 ranks and an HSDP mesh
# 2 x 2, then the failing
# minibatch with a 20 s timeout to show what a GPU peer reports.
# Usage (repository root on the GPU machine): dev/gpu/torch_frozen_one_gpu.sh SNAPSHOT
#   SNAPSHOT: a folder with libodc.so (CUDA build), python/ and tests/ of the tree under test.
# Output: $OUT/torch_frozen.log
set -uo pipefail
snapshot=${1:?usage: $0 SNAPSHOT}
export PYTHONPATH=$snapshot/python:$snapshot/tests/python ODC_LIBRARY=$snapshot/libodc.so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
log="${OUT:-/tmp}/torch_frozen.log"
status=0
source "$(dirname "$0")/stage.sh"
{ date -u; nvidia-smi -L; } >>"$log" 2>&1
for ranks in 2 4; do
  stage "frozen-$ranks-ranks" 240 python3 -c "
from test_torch_fsdp2_frozen import check_frozen_unused_and_adapter_parameters as check
check($ranks, 'cuda', tolerance=1e-4)
print('frozen, unused and adapter parameters: ok on $ranks ranks')"
done
stage frozen-hsdp-2x2 240 python3 -c "
from test_torch_fsdp2_frozen import check_frozen_unused_and_adapter_parameters as check
check(4, 'cuda', tolerance=1e-4, mesh=(2, 2))
print('frozen, unused and adapter parameters: ok on an HSDP mesh 2 x 2')"
stage failure-on-gpu 240 python3 -c "
import os, tempfile, odc
from test_torch_fsdp2_frozen import _failure_rank
with tempfile.TemporaryDirectory() as d:
    results = odc.launch(_failure_rank, 2, os.path.join(d, 'store'), 'cuda', 20, timeout=200)
for rank, (seen, _) in enumerate(results):
    print('rank', rank, {k: v for k, v in seen.items()})"
stage abort-cuda 200 env PYTHONPATH=$PYTHONPATH:$snapshot/tests/gpu python3 -c "
import time, odc, test_cuda_comm as suite
start = time.monotonic()
suite.test_aborting_rank_ends_peers_device_waits_at_once()
print(f'aborting rank named by its peer\'s device barrier in {time.monotonic() - start:.1f} s')"
exit $status
