#!/usr/bin/env python3
"""Generates the shipped sample-length files (one token count per line, '#' header lines).

The distributions imitate three public post-training workloads; they are synthetic, fixed-seed and
reproducible with the Python standard library alone (`python3 data/generate_lengths.py`).

| file                 | imitates                  | distribution (tokens)                         | range        |
|----------------------|---------------------------|-----------------------------------------------|--------------|
| longalign_like.txt   | long-context SFT          | log-normal, median 12,700, sigma 0.95         | 512..65,536  |
| swe_smith_like.txt   | agent trajectories        | log-normal, median 34,500, sigma 0.42         | 2,048..65,536|
| aime_rl_like.txt     | RL rollouts (math)        | gamma, shape 4, scale 2,250                   | 256..32,768  |
| heavy_tailed.txt     | mixed SFT with outliers   | log-normal, median 2,500, sigma 1.344         | 128..65,536  |

Draws outside the range are redrawn (not clipped), so there is no spike at the maximum.
Resulting means: about 16.4K, 35.0K and 9.1K tokens. heavy_tailed (issue #14, outliers that no
balancer can hide) has its 90th percentile at about 14K (sigma = ln(14000/2500) / 1.2816) and a few
percent of samples above 32K.
"""

import math
import random
import statistics
from pathlib import Path

NUM_SAMPLES = 10_000


def _draw(rng: random.Random, kind: str) -> float:
    if kind == "longalign":
        return rng.lognormvariate(math.log(12_700), 0.95)
    if kind == "swe_smith":
        return rng.lognormvariate(math.log(34_500), 0.42)
    if kind == "heavy":
        return rng.lognormvariate(math.log(2_500), 1.344)
    return rng.gammavariate(4.0, 2_250)


DATASETS = {
    # name: (kind, seed, min tokens, max tokens, description)
    "longalign_like": ("longalign", 1, 512, 65_536, "long-context SFT like LongAlign"),
    "swe_smith_like": ("swe_smith", 2, 2_048, 65_536, "agent trajectories like SWE-Smith"),
    "aime_rl_like": ("aime", 3, 256, 32_768, "RL responses like AIME rollouts"),
    "heavy_tailed": ("heavy", 4, 128, 65_536, "heavy-tailed SFT lengths with rare long outliers"),
}


def generate(name: str, num_samples: int = NUM_SAMPLES) -> list[int]:
    kind, seed, low, high, _ = DATASETS[name]
    rng = random.Random(seed)
    lengths: list[int] = []
    while len(lengths) < num_samples:
        value = int(round(_draw(rng, kind)))
        if low <= value <= high:
            lengths.append(value)
    return lengths


def main(names=None) -> None:
    out_dir = Path(__file__).resolve().parent
    for name, (_, seed, low, high, description) in DATASETS.items():
        if names and name not in names:
            continue
        lengths = generate(name)
        header = [
            f"# {description}: {len(lengths)} synthetic sample lengths (tokens)",
            f"# made by data/generate_lengths.py (seed {seed}, range {low}..{high}); "
            f"mean {statistics.mean(lengths):.0f}, max {max(lengths)}",
        ]
        text = "\n".join(header + [str(length) for length in lengths]) + "\n"
        (out_dir / f"{name}.txt").write_text(text)
        print(f"{name}: mean {statistics.mean(lengths):.0f}, max {max(lengths)}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])  # names of the files to write (default: all)
