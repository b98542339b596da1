#!/usr/bin/env bash
# The main job: predicts, on the three shipped sample datasets, the idle ("bubble") rate of each
# load-balancing policy under collective FSDP and under ODC: 8 ranks, minibatches of 32 samples,
# 64K tokens per microbatch, and the cost model fitted for a 7B model.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

scripts/setup.sh
scripts/build.sh >/dev/null
cost_7b="0.00027401178,0.0000000042464424,0"
for dataset in longalign_like swe_smith_like aime_rl_like; do
  echo
  echo "== data/$dataset.txt: 8 ranks, 32 samples per minibatch, max 65536 tokens, 7B cost =="
  .venv/bin/odc compare --lengths "data/$dataset.txt" --ranks 8 --minibatch-size 32 \
    --max-tokens 65536 --cost "$cost_7b"
done
