"""Prints the memory breakdown of `odc train` result files (issue 17): per run, peak = torch peak
+ odc symmetric memory (published shards + accumulators), and the torch peak split into what was
held when its phase began and what the phase added. `publ` is the published buffers, `inpl` the
part of them that is FSDP2's own sharded parameters moved there (odc.torch R7: not held by torch
any more, so not extra). Usage: python3 dev/analysis/memory_table.py FILE.json..."""

import json
import sys

GIB = 2**30


def main(paths):
    runs = []
    for path in paths:
        runs.extend(json.load(open(path)))
    base = {r["preset"]: r["peak_memory_bytes"] for r in runs if r["comm"] == "collective"}
    print(
        f"{'preset':6} {'comm':10} {'policy':9} {'peak':>6} {'ratio':>6} {'torch':>6} "
        f"{'publ':>5} {'inpl':>5} {'accum':>5} {'scr':>5} {'held':>6} {'trans':>6}  peak phase (tokens), "
        "largest microbatch"
    )
    for r in runs:
        m = r.get("memory", {})
        ratio = (
            r["peak_memory_bytes"] / base[r["preset"]] if base.get(r["preset"]) else float("nan")
        )
        print(
            f"{r['preset']:6} {r['comm']:10} {r['policy']:9} {r['peak_memory_bytes'] / GIB:6.2f} "
            f"{ratio:5.3f}x {m.get('torch_peak_bytes', 0) / GIB:6.2f} "
            f"{m.get('odc_published_bytes', 0) / GIB:5.2f} "
            f"{m.get('odc_published_in_place_bytes', 0) / GIB:5.2f} "
            f"{m.get('odc_accumulators_bytes', 0) / GIB:5.2f} "
            f"{m.get('odc_grad_scratch_bytes', 0) / GIB:5.2f} "
            f"{m.get('held_before_peak_phase_bytes', 0) / GIB:6.2f} "
            f"{m.get('transient_in_peak_phase_bytes', 0) / GIB:6.2f}  "
            f"{m.get('peak_phase', '?')} ({m.get('peak_phase_tokens', 0)}), "
            f"{m.get('largest_microbatch_tokens', 0)}; held at minibatch begin "
            f"{m.get('held_at_last_minibatch_begin_bytes', 0) / GIB:.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
