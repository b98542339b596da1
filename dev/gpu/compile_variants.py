"""How often torch compiles odc.train's decoder blocks again as the token count changes, and what
each inductor setting costs per microbatch (issue #42: "one compile per preset"). One GPU, the
preset as odc.train builds it (bf16, activation checkpointing, compile_blocks), no FSDP: per
inductor variant a fresh process runs forward + backward over a ladder of packed microbatch
sizes (two passes), and prints the compiles each size caused (first pass) and its wall time
(second pass, compiled code only).

  python dev/gpu/compile_variants.py [--preset 1.5b] [--variants default,no-split,...]

Variants (torch._inductor.config): default; no-split (split_reductions=False: inductor decides
whether to split a reduction over the token dimension from the size it first saw, a guard that
recompiles across the threshold); no-split-no-persistent (also persistent_reductions=False).
"""

import argparse
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "no-split": {"split_reductions": False},
    "no-split-no-persistent": {"split_reductions": False, "persistent_reductions": False},
}
# (tokens, documents): sizes on both sides of the thresholds seen on an H200 (3.4K, 4K tokens),
# several documents per microbatch as packing makes them, up to a 64K-token microbatch.
LADDER = [
    (512, 1), (1024, 2), (2048, 1), (2896, 3), (3620, 1), (4096, 2), (5160, 1), (8192, 4),
    (9194, 4), (16384, 2), (32768, 8), (65536, 4), (700, 1),
]  # fmt: skip


def _one_variant(preset: str, variant: str) -> None:
    import torch
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.config as inductor_config

    from odc.train import model as train_model

    for key, value in VARIANTS[variant].items():
        setattr(inductor_config, key, value)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with device:
        model = train_model.build_model(preset)
    model.gradient_checkpointing_enable()
    assert train_model.compile_blocks(model)
    model.to(torch.bfloat16)

    def run(tokens: int, documents: int) -> float:
        ids = torch.randint(0, 1000, (tokens,), device=device)
        cuts = [tokens * i // documents for i in range(documents + 1)]
        boundaries = torch.tensor(cuts, dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(b - a, device=device) for a, b in zip(cuts, cuts[1:])])
        longest = max(b - a for a, b in zip(cuts, cuts[1:]))
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(ids, positions, torch.roll(ids, -1), boundaries, longest).backward()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    compiles, first = {}, {}
    for tokens, documents in LADDER:
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        first[tokens] = run(tokens, documents)
        compiles[tokens] = dynamo_utils.counters["stats"]["unique_graphs"] - before
    for tokens, documents in LADDER:
        again = min(run(tokens, documents) for _ in range(3))
        print(
            f"{variant:24} {tokens:7d} {documents:4d} {compiles[tokens]:9d} "
            f"{first[tokens]:9.2f} {again * 1e3:9.1f}",
            flush=True,
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1.5b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this variant only
    args = parser.parse_args(argv)
    if args.one:
        _one_variant(args.preset, args.one)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    print(f"preset {args.preset}, one GPU; graphs: compiles the size caused (first pass); "
          "first s: its first forward + backward; ms: the best of three later ones")  # fmt: skip
    print(f"{'variant':24} {'tokens':>7} {'docs':>4} {'graphs':>9} {'first s':>9} {'ms':>9}")
    status = 0
    for variant in variants:  # a fresh process each: inductor's settings and caches are global
        done = subprocess.run(
            [sys.executable, __file__, "--preset", args.preset, "--one", variant],
            env=dict(
                os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0"
            ),
        )
        status = status or done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
