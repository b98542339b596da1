#!/usr/bin/env bash
# Issue 17 on the 4 x H200 machine: the odc.torch GPU tests, then peak GPU memory with its
# breakdown for collective + lb-micro, odc + lb-micro (same plan as collective: ODC's own cost)
# and odc + lb-mini (plus LB-Mini's packing) at 64K on the 1.5b and 7b presets, 2 minibatches
# each (1 warm-up + 1 measured), cost models given (no calibration). The 1.5b compare runs under
# torchrun (env:// rendezvous, communicator from the process group); the rest self-launch.
# Expected run time: ~5 minutes (tests ~1 min, 1.5b ~1.5 min, 7b ~2.5 min).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
OUT_DIR="$OUT/issue17"
WORK=$(mktemp -d)
mkdir -p "$OUT_DIR" "$WORK/results"
LOG="$OUT_DIR/issue17.log"
exec > >(tee "$LOG") 2>&1
date -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(0))"
git log --oneline -1 || true

echo "=== GPU tests: tests/gpu/test_torch_gpu.py"
python3 -m pytest -q -s tests/gpu/test_torch_gpu.py 2>&1 | tail -15 || echo "GPU TESTS FAILED"

COMMON=(--lengths data/longalign_like.txt --max-length 65536 --steps 1 --samples-per-rank 4 --timeline "")
COST_15B=3.123e-05,1.187e-09,0.07082   # fitted at 64K, docs/benchmarks.md (issue 7)
COST_7B=0.0001096,2.713e-09,0.1033     # fitted at 64K, docs/benchmarks.md (7b)

run() {  # name, then odc.train arguments
  local name=$1; shift
  echo "=== $name: $*"
  local start=$SECONDS
  if "$@" --output "$WORK/results/$name.json"; then
    echo "=== $name done in $((SECONDS - start)) s"
  else
    echo "=== $name FAILED (exit $?) after $((SECONDS - start)) s"
    return 1
  fi
}

# 1.5b: collective + lb-micro and odc + lb-mini under torchrun; self-launched if torchrun fails.
run 1.5b_compare_torchrun python3 -m torch.distributed.run --standalone --nproc_per_node 4 \
    -m odc.train --preset 1.5b "${COMMON[@]}" --compare --cost $COST_15B \
  || run 1.5b_compare python3 -m odc.train --preset 1.5b "${COMMON[@]}" --compare --cost $COST_15B || true
run 1.5b_odc_lb-micro python3 -m odc.train --preset 1.5b "${COMMON[@]}" --comm odc --policy lb-micro --cost $COST_15B || true
run 7b_compare python3 -m odc.train --preset 7b "${COMMON[@]}" --compare --cost $COST_7B || true
run 7b_odc_lb-micro python3 -m odc.train --preset 7b "${COMMON[@]}" --comm odc --policy lb-micro --cost $COST_7B || true

echo "=== memory breakdown (GiB; slowest = largest-peak rank)"
python3 dev/gpu/issue17_memory_table.py "$WORK"/results/*.json || true
tar -czf "$OUT_DIR/issue17_results.tgz" -C "$WORK" results
date -u
