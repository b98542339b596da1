#!/usr/bin/env bash
# Session 8 (issue #12, hierarchical gathers) on whatever GPUs the machine has (2 or 4):
#   tests  the hierarchical-gather tests of tests/gpu/test_nvshmem_comm.py (gathers inside
#          minibatches in every mode, fan-out to a node peer, a late node fetch);
#   bench  odc_bench --transport nvshmem (its minibatch table) on pretended nodes, hierarchical
#          gathers off and on, bytes fetched from other "nodes" printed (ODC_NVSHMEM_STATS=1);
#   train  odc.train (1.5b, ODC + LB-Mini, 4 measured minibatches) on the CUDA transport, then
#          over NVSHMEM on two "nodes" of half the GPUs each, hierarchical gathers off and on;
#   suite  the NVSHMEM, CUDA-transport and odc.torch GPU suites.
# Usage: dev/gpu/session8.sh [tests] [bench] [train] [suite]   (default: tests bench).
# Output: $OUT/session8/session8.log and the training results (JSON).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
dest="${OUT:-/tmp}/session8"
mkdir -p "$dest"
log="$dest/session8.log"
status=0
source "$(dirname "$0")/stage.sh"
what=${*:-tests bench}
gpus=$(nvidia-smi -L | wc -l)
{ date -u; git log -1 --oneline 2>/dev/null; nvidia-smi -L; } >>"$log" 2>&1

if [[ " $what " == *" tests "* ]]; then
  stage window-tests 300 python3 -m pytest -x -q -rs tests/gpu/test_nvshmem_comm.py \
    -k "gathers_inside or fans_out or late_node_fetch"
fi
if [[ " $what " == *" bench "* ]]; then
  for per_node in 1 2; do
    [ "$per_node" -lt "$gpus" ] || continue
    for gather in 0 1; do
      stage "bench-nodes$per_node-hgather$gather" 200 env ODC_LOCAL_WORLD_SIZE=$per_node \
        ODC_NVSHMEM_HIERARCHICAL_GATHER=$gather ODC_NVSHMEM_STATS=1 \
        .device/odc_bench --transport nvshmem 1 64 "$gpus"
    done
  done
fi
if [[ " $what " == *" train "* ]]; then
  export OMP_NUM_THREADS=4
  train=(python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" -m odc.train
    --preset 1.5b --samples-per-rank 4 --cost 3.123e-05,1.187e-09,0.07082 --comm odc
    --policy lb-mini --lengths data/longalign_like.txt --max-length 16384 --steps 4
    --timeline "")
  # TRAIN_CUDA=0 skips the CUDA-transport reference; TRAIN_GATHERS lists the NVSHMEM runs'
  # ODC_NVSHMEM_HIERARCHICAL_GATHER values in order (repeats: "0 1 0 1").
  [ "${TRAIN_CUDA:-1}" = 0 ] || stage train-cuda 240 "${train[@]}" --output "$dest/train_cuda.json"
  round=0
  for gather in ${TRAIN_GATHERS:-0 1}; do
    round=$((round + 1))
    # The staged accumulators need 4 S (1 + 2 N) bytes per element of shard S on the heap.
    stage "train-nvshmem-hgather$gather" 240 env ODC_TRANSPORT=nvshmem \
      ODC_LOCAL_WORLD_SIZE=$((gpus / 2)) \
      ODC_NVSHMEM_HIERARCHICAL_GATHER=$gather ODC_NVSHMEM_HEAP_GIB=48 ODC_NVSHMEM_STATS=1 \
      "${train[@]}" --output "$dest/train_nvshmem_hgather${gather}_$round.json"
  done
  python3 - "$dest" >>"$log" 2>&1 <<'PY' || status=1
import json, sys
from pathlib import Path
dest = Path(sys.argv[1])
base = None
for path in sorted(dest.glob("train_*.json"), key=lambda p: (p.stat().st_mtime, p.name)):
    name = path.stem
    r = json.loads(path.read_text())[0]
    base = base or r
    print(f"{name:24} {r['samples_per_second']:7.3f} samples/s "
          f"({r['samples_per_second'] / base['samples_per_second']:.3f}x the first)  per minibatch "
          f"{[round(x, 3) for x in r.get('minibatch_seconds', [])]}  peak "
          f"{r['peak_memory_bytes'] / 2**30:.1f} GiB  losses {r['losses'][:3]}")
PY
fi
if [[ " $what " == *" suite "* ]]; then
  # The GPU suites this change touches: NVSHMEM (through its calls, and on one-GPU "nodes"; on 4
  # GPUs also two-GPU "nodes"), the CUDA transport (the core's window hooks), odc.torch.
  # SUITE_K: another -k expression (e.g. "nodes2": the NVSHMEM suite on two-GPU "nodes" only).
  modes="not direct and not nodes2"
  [ "$gpus" -ge 4 ] && modes="not direct"
  stage suites 420 python3 -m pytest -q -rs tests/gpu/test_nvshmem_comm.py \
    tests/gpu/test_cuda_comm.py tests/gpu/test_torch_gpu.py -k "${SUITE_K:-$modes}"
fi
echo "status $status" | tee -a "$log"
exit $status
