#!/usr/bin/env bash
# Issue #11 on the 4-GPU machine (the protocol moved into core; CUDA transport behind the narrow
# transport interface):
# 1. odc_cuda_smoke (2 ranks, checked sums);
# 2. odc_bench 1 1024 of this branch, then of main (.device/base/odc_bench, placed by the lead),
#    both tables printed: the default path (remote fp32 adds, SM gather) must not be slower;
# 3. the deterministic-mode GPU tests first (bitwise identical sums under different random delays;
#    sums read right after minibatch_end with no barrier), then the whole GPU suite.
# Expected run time: ~15 s smoke + 2 x ~40 s bench + ~3 min tests (about 4.5 min; at most 7.7 by the
# timeouts).
# Output: $OUT/issue11/issue11.log (one file).
set -euo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so ODC_CLI=$PWD/.device/odc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# odc_bench needs a libnccl.so.2 at run time: torch's wheel has one.
nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.device${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dest="$OUT/issue11"
mkdir -p "$dest"
log="$dest/issue11.log"
exec > >(tee "$log") 2>&1
status=0
step() {  # step NAME SECONDS COMMAND...: runs it, logs rc and time, never stops the script
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "== $name =="
  timeout "$limit" "$@" || rc=$?
  echo "-- $name: rc=$rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || status=1
}
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
git log -1 --oneline || true
step "odc_cuda_smoke" 40 .device/odc_cuda_smoke
step "odc_bench 1 1024 (this branch)" 80 .device/odc_bench 1 1024
if [ -x .device/base/odc_bench ]; then
  step "odc_bench 1 1024 (main, .device/base)" 80 .device/base/odc_bench 1 1024
else
  echo "== .device/base/odc_bench missing: no before/after comparison =="
fi
step "deterministic + no-barrier GPU tests" 90 python3 -m pytest -q -rs \
  tests/gpu/test_cuda_comm.py -k "deterministic or without_barrier"
step "rest of the GPU suite" 170 python3 -m pytest -q -rs tests/gpu \
  -k "not (deterministic or without_barrier)"
echo "overall status=$status"
exit "$status"
