#!/usr/bin/env bash
# `python -m odc.fit` (issue #28) on one GPU: the cost model of a Qwen2-1.5B-shaped model
# (data/configs/qwen2_1_5b.json, random weights) up to 32K-token microbatches in bf16, with
# gradient checkpointing (as odc.train runs on GPUs) and without (a rung may run out of memory:
# the ladder stops there and says so); each printed --cost is checked by the planner, and the
# fits are set beside docs/planner.md's 1.5b row (one H200, design.md). About 2 minutes.
# Usage (repository root on the GPU machine): dev/gpu/fit_one_gpu.sh [SNAPSHOT]
#   SNAPSHOT: a folder with libodc.so and python/ of the tree under test; default: this tree's
#   python/ and .device/libodc.so.
# Output: $OUT/fit.log, $OUT/fit_1_5b_gc.json, $OUT/fit_1_5b_no_gc.json
set -uo pipefail
snapshot=${1:-}
if [ -n "$snapshot" ]; then
  export PYTHONPATH=$snapshot/python ODC_LIBRARY=$snapshot/libodc.so
else
  export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-/tmp}
log="$out/fit.log"
status=0
source "$(dirname "$0")/stage.sh"
config=data/configs/qwen2_1_5b.json
{ date -u; nvidia-smi -L; git rev-parse HEAD 2>/dev/null
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} >>"$log" 2>&1
fit=(python3 -m odc.fit "$config" --max-tokens 32768 --dtype bfloat16 --device cuda --repeats 3)
stage fit-1.5b-gc 300 "${fit[@]}" --gradient-checkpointing --json "$out/fit_1_5b_gc.json"
stage fit-1.5b-no-gc 300 "${fit[@]}" --no-gradient-checkpointing --json "$out/fit_1_5b_no_gc.json"
# Each fit's --cost through the planner (LB-Mini, 4 ranks, RL-shaped lengths), and its predicted
# microbatch times beside docs/planner.md's 1.5b row (c + a L + b L^2, no floor).
stage plan-and-compare 120 python3 - "$out" <<'PY'
import json, pathlib, sys
import odc
table = (1.69e-5, 9.75e-10, 0.069)  # docs/planner.md: Qwen2-1.5B shape, one H200
lengths = odc.read_lengths("data/aime_rl_like.txt")[:256]
for path in sorted(pathlib.Path(sys.argv[1]).glob("fit_1_5b_*.json")):
    fit = json.loads(path.read_text())
    cost = tuple(fit["cost"][k] for k in ("a", "b", "c", "floor"))
    plan = odc.plan(lengths, ranks=4, max_tokens=32768, policy="lb-mini", minibatch_size=64, cost=cost)
    print(f"{path.name}: {fit['flag']} ({fit['model']}); stopped: {fit['stopped']}")
    print(f"  odc plan takes it: bubble {plan['bubble']}")
    print(f"  {'tokens':>7} {'measured':>9} {'this fit':>9} {'docs row':>9}")
    for rung in [fit["floor_microbatch"], *fit["ladder"]]:
        n = rung["tokens"]
        docs = table[2] + table[0] * n + table[1] * n * n
        print(f"  {n:7d} {rung['seconds']:9.4f} {rung['predicted']:9.4f} {docs:9.4f}")
PY
exit $status
