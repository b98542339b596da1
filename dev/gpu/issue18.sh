#!/usr/bin/env bash
# Issue #18 (items 13-15) on the 4-GPU machine. Runs:
# 1. tests/gpu/test_hardening_gpu.py: device barrier carries the collective (mismatch named on both
#    ranks), destroy right after enqueuing a gather (completes and meets peers before freeing),
#    odc.torch refuses optimizer.step() after a device timeout in minibatch_end (params unchanged);
# 2. regressions on the paths these change (device barrier kernel, destroy barrier, named buffers
#    in odc.torch): tests/gpu/test_cuda_comm.py without its 1,000-minibatch case, one odc.torch GPU
#    test, and the odc_cuda_smoke binary.
# Expected run time: ~45 s (1) + ~90 s (2), under 3 min; every step runs under `timeout`.
# Output: $OUT/issue18/issue18.log (one file).
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so ODC_CLI=$PWD/.device/odc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
dest="$OUT/issue18"
mkdir -p "$dest"
log="$dest/issue18.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  git log -1 --oneline || true
  rc=0
  echo "== 1. issue #18 GPU tests (items 13, 14, 15) =="
  start=$SECONDS
  timeout 100 python3 -m pytest -q -rs -v --durations=5 tests/gpu/test_hardening_gpu.py || rc=$?
  echo "issue18 tests rc=$rc in $((SECONDS - start)) s"
  echo "== 2. regressions: CUDA transport tests, one odc.torch GPU test, cuda smoke =="
  start=$SECONDS
  rc2=0
  timeout 150 python3 -m pytest -q -rs --durations=5 tests/gpu/test_cuda_comm.py \
    -k "not thousand" \
    "tests/gpu/test_torch_gpu.py::test_unequal_counts_fp32_equal_single_process" || rc2=$?
  echo "regression tests rc=$rc2 in $((SECONDS - start)) s"
  rc3=0
  if [ -x .device/odc_cuda_smoke ]; then
    LD_LIBRARY_PATH=$PWD/.device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} timeout 60 \
      .device/odc_cuda_smoke || rc3=$?
    echo "odc_cuda_smoke rc=$rc3"
  else
    echo "odc_cuda_smoke: not built into .device (skipped)"
  fi
  date -u
  [ "$rc" -eq 0 ] && [ "$rc2" -eq 0 ] && [ "$rc3" -eq 0 ]
} 2>&1 | tee "$log"
