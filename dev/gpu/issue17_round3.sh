#!/usr/bin/env bash
# Issue 17 on the 4 x H200 machine, third round: peak GPU memory after LB-Mini's default bound
# (--microbatch-memory lb-micro: no LB-Mini microbatch above the largest LB-Micro builds for the
# same minibatch; docs/planner.md, "Microbatch memory"). Same data and presets as rounds one and
# two (longalign_like at 64K, 1.5b and 7b, 4 samples per rank, the 64K cost fits), --compare
# (collective + lb-micro, odc + lb-mini), now 3 measured minibatches after the warm-up (rounds
# one and two measured 1), so that minibatches where FSDP2 peaks in its gradient-free first
# microbatch are in the sample too. Expected run time: ~7 minutes; every step has a timeout.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
OUT_DIR="$OUT/issue17_round3"
WORK=$(mktemp -d)
mkdir -p "$OUT_DIR" "$WORK/results"
LOG="$OUT_DIR/issue17_round3.log"
exec > >(tee "$LOG") 2>&1
date -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(0))"
git log --oneline -1 || true

COMMON=(--lengths data/longalign_like.txt --max-length 65536 --steps 3 --samples-per-rank 4 --timeline "")
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

run 1.5b_compare_torchrun 150 python3 -m torch.distributed.run --standalone --nproc_per_node 4 \
    -m odc.train --preset 1.5b "${COMMON[@]}" --compare --cost $COST_15B
run 7b_compare 270 python3 -m odc.train --preset 7b "${COMMON[@]}" --compare --cost $COST_7B

echo "=== memory breakdown (GiB; the rank with the largest peak)"
python3 dev/gpu/issue17_memory_table.py "$WORK"/results/*.json || true
tar -czf "$OUT_DIR/issue17_round3_results.tgz" -C "$WORK" results
date -u
