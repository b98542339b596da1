#!/usr/bin/env bash
# Where ODC's minibatch tail goes on balanced data (issue #14's 0.95x control), after sm_budget.sh
# found ODC's last measured minibatch ~0.2 s longer than the others in every ODC run (not under
# collectives) and its other tails ~20 ms longer: odc.train now records the host time of each
# call after the last microbatch (tail_phase_seconds) and freezes the objects built before the
# loop out of the garbage collector. Runs: 1.5b, --constant-length 8192, 4 samples per rank, 4
# measured minibatches; collective + lb-micro, odc + lb-mini (all SMs), odc + lb-mini
# (ODC_CUDA_SMS=32). Output: $OUT/balanced_tail/*.json and the log. ~2 minutes.
set -uo pipefail
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
dest="$OUT/balanced_tail"
mkdir -p "$dest"
exec > >(tee "$dest/balanced_tail.log") 2>&1
date -u
train=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train --preset 1.5b
  --samples-per-rank 4 --cost 3.123e-05,1.187e-09,0.07082 --lengths data/longalign_like.txt
  --constant-length 8192 --steps 4 --timeline "")
timeout 70 "${train[@]}" --comm collective --policy lb-micro --output "$dest/collective.json" | tail -3
timeout 70 "${train[@]}" --comm odc --policy lb-mini --output "$dest/odc_all.json" | tail -3
ODC_CUDA_SMS=32 timeout 70 "${train[@]}" --comm odc --policy lb-mini --output "$dest/odc_32.json" | tail -3
python3 - "$dest" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    (run,) = json.loads(path.read_text())
    print(path.stem, "samples/s", round(run["samples_per_second"], 2),
          "spans", [round(x, 3) for x in run["minibatch_seconds"]])
    for phases in run["tail_phase_seconds"]:
        print("   tail ms", {k: round(1000 * v, 1) for k, v in phases.items()})
PY
date -u
