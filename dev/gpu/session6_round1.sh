#!/usr/bin/env bash
# Sixth round on the 4 x H200 machine (issue #17, memory): the GPU tests of the narrowing gather
# (float32 shards pulled straight into bfloat16, CUDA and NVSHMEM transports), of the ODC_CUDA_SMS
# budget (written last round, not run), of odc.torch on GPUs (FSDP2 equivalence, now with no
# .grad kept during a minibatch), then the 7b --compare memory run of issue17_round3.sh on this
# code. Expected: ~8 minutes; every step has a timeout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
OUT_DIR="$OUT/session6_round1"
WORK=$(mktemp -d)
mkdir -p "$OUT_DIR" "$WORK/results"
exec > >(tee "$OUT_DIR/session6_round1.log") 2>&1
date -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(0))"
status=0
step() {  # name, timeout in seconds, then the command
  local name=$1 limit=$2; shift 2
  echo "=== $name (timeout $limit s): $*"
  local start=$SECONDS rc=0
  timeout "$limit" "$@" || rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || status=1
}
step "CUDA gather (narrowing) + SM budget" 90 python3 -m pytest -q -rs -x \
  tests/gpu/test_cuda_comm.py -k "gather or sm_budget"
step "NVSHMEM gather (narrowing), calls / direct / 2 pretended nodes" 120 python3 -m pytest -q -rs \
  tests/gpu/test_nvshmem_comm.py -k "gather"
step "odc.torch on GPUs (FSDP2 equivalence, HSDP)" 150 python3 -m pytest -q -rs \
  tests/gpu/test_torch_gpu.py tests/gpu/test_torch_hybrid_gpu.py
step "7b --compare, memory" 270 python3 -m odc.train --preset 7b --lengths data/longalign_like.txt \
  --max-length 65536 --steps 3 --samples-per-rank 4 --timeline "" --compare \
  --cost 0.0001096,2.713e-09,0.1033 --output "$WORK/results/7b_compare.json"
python3 dev/gpu/issue17_memory_table.py "$WORK"/results/*.json || true
tar -czf "$OUT_DIR/session6_round1_results.tgz" -C "$WORK" results
date -u
echo "overall status=$status"
