#!/usr/bin/env bash
# Issue 17 on the 4 x H200 machine, second round: peak GPU memory with its breakdown after
# (1) LB-Mini's memory-aware packing (planner: each rank's fewest count packed by tokens, and no
# microbatch above the minibatch's longest sample where the rank's predicted time allows) and
# (2) FSDP2's sharded parameters living in odc's published buffers (no bf16 shard copy; float32
# pulled and cast in place). Same runs as the first round (docs/benchmarks.md, issue #17):
# collective + lb-micro and odc + lb-mini (--compare), and odc + lb-micro (ODC on the plan
# collective runs), 1.5b and 7b presets at 64K, 2 minibatches each (1 warm-up), cost models
# given. First the odc.torch GPU tests (losses equal plain FSDP2's through the new gather path).
# Expected run time: ~5 minutes (tests ~45 s, 1.5b ~1.5 min, 7b ~2.8 min); every step has its
# own timeout (sum 480 s).
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
timeout 80 python3 -m pytest -q -s tests/gpu/test_torch_gpu.py 2>&1 | tail -15 \
  || echo "=== GPU TESTS FAILED OR TIMED OUT"

COMMON=(--lengths data/longalign_like.txt --max-length 65536 --steps 1 --samples-per-rank 4 --timeline "")
COST_15B=3.123e-05,1.187e-09,0.07082   # fitted at 64K, docs/benchmarks.md (issue 7)
COST_7B=0.0001096,2.713e-09,0.1033     # fitted at 64K, docs/benchmarks.md (7b)

run() {  # name, timeout in seconds, then odc.train arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name (timeout $limit s): $*"
  local start=$SECONDS status=0
  timeout "$limit" "$@" --output "$WORK/results/$name.json" || status=$?
  if [ "$status" -eq 0 ]; then
    echo "=== $name done in $((SECONDS - start)) s"
  else
    echo "=== $name FAILED (exit $status; 124 = timeout) after $((SECONDS - start)) s"
  fi
}

run 1.5b_compare_torchrun 90 python3 -m torch.distributed.run --standalone --nproc_per_node 4 \
    -m odc.train --preset 1.5b "${COMMON[@]}" --compare --cost $COST_15B
run 1.5b_odc_lb-micro 60 python3 -m odc.train --preset 1.5b "${COMMON[@]}" --comm odc --policy lb-micro --cost $COST_15B
run 7b_compare 160 python3 -m odc.train --preset 7b "${COMMON[@]}" --compare --cost $COST_7B
run 7b_odc_lb-micro 90 python3 -m odc.train --preset 7b "${COMMON[@]}" --comm odc --policy lb-micro --cost $COST_7B

echo "=== memory breakdown (GiB; the rank with the largest peak)"
python3 dev/gpu/issue17_memory_table.py "$WORK"/results/*.json || true
tar -czf "$OUT_DIR/issue17_results.tgz" -C "$WORK" results
date -u
