#!/usr/bin/env bash
# Why a short microbatch costs ODC more (issue #14: on heavy-tailed data an 852-token microbatch
# after a split chunk took 0.30 s under ODC, predicted 0.10 s): one 1024-token sample per rank
# per minibatch, so every minibatch is one short microbatch per rank; collective vs ODC
# (--compare), then ODC with all SMs (ODC_CUDA_SMS=132) against odc.train's 32. Expected ~3 min.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so OMP_NUM_THREADS=4
mkdir -p "$OUT/small"
common=(python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m odc.train --preset 1.5b
  --lengths data/longalign_like.txt --constant-length 1024 --samples-per-rank 1 --steps 6
  --cost 3.123e-05,1.187e-09,0.07082 --timeline "")
timeout 150 "${common[@]}" --compare --output "$OUT/small/compare.json" 2>&1 | grep -v "^\[" | tail -12
ODC_CUDA_SMS=132 timeout 100 "${common[@]}" --comm odc --policy lb-mini --output "$OUT/small/odc_all_sms.json" 2>&1 | grep -v "^\[" | tail -6
python3 - "$OUT/small" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for r in json.loads(path.read_text()):
        spans = [round(s, 3) for s in r["minibatch_seconds"]]
        mbs = [round(b - a, 3) for rank in r["timeline"] for a, b, n in rank]
        print(path.name, r["comm"], r.get("odc_cuda_sms"), "spans", spans, "last microbatches", mbs,
              "tail", r.get("tail_phase_seconds", [])[-1:] )
PY
