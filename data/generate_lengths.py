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

| grpo_math_like.tsv   | GRPO rollouts (math RL)   | per prompt: prompt uniform 100..300; G = 8    | response     |
|                      |                           | responses drawn from a mixture with modes     | 200..20,000  |
|                      |                           | 5K/9K/13K/18K (weights .50/.15/.09/.26, sd    | (truncated   |
|                      |                           | .45/.15/.10/.10 of the mode), correlated in   |  at 20,000)  |
|                      |                           | the group: each response keeps its prompt's   |              |
|                      |                           | mode with probability 0.7                     |              |

Draws outside the range are redrawn (not clipped), so there is no spike at the maximum; except
grpo_math_like, where a response that reaches the maximum response length is truncated there, as a
generation cap truncates it (3.6% of responses). Its columns are `group prompt_tokens
response_tokens` (G consecutive rows per group); grpo_math_like.txt holds the same samples' total
lengths (prompt + response), one per line, for the planner and simulator.
Resulting means: about 16.4K, 35.0K and 9.1K tokens; grpo_math_like's responses: mean about
9.7K, standard deviation about 5.7K (published math-RL traces: mean ~9.6K, sd ~5.9K).
heavy_tailed (issue #14, outliers that no balancer can hide) has its 90th percentile at about 14K (sigma = ln(14000/2500) / 1.2816) and a few
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


# GRPO rollouts: (mode tokens, weight, sd as a fraction of the mode) of the response mixture.
GRPO_MODES = [(5_000, 0.50, 0.45), (9_000, 0.15, 0.15), (13_000, 0.09, 0.10), (18_000, 0.26, 0.10)]
GRPO_KEEP_MODE = 0.7  # a response keeps its prompt's mode with this probability (correlation)


def generate_grpo(
    num_prompts: int = 1_250,
    group_size: int = 8,
    max_response: int = 20_000,
    seed: int = 5,
) -> list[tuple[int, int, int]]:
    """(group, prompt tokens, response tokens) per response, `group_size` per prompt."""
    rng = random.Random(seed)
    modes = [m for m, _, _ in GRPO_MODES]
    weights = [w for _, w, _ in GRPO_MODES]
    spreads = {m: sd for m, _, sd in GRPO_MODES}
    rows = []
    for group in range(num_prompts):
        prompt = rng.randint(100, 300)
        prompt_mode = rng.choices(modes, weights)[0]
        for _ in range(group_size):
            mode = prompt_mode if rng.random() < GRPO_KEEP_MODE else rng.choices(modes, weights)[0]
            response = 0
            while response < 200:  # redrawn below 200 tokens
                response = int(round(rng.gauss(mode, spreads[mode] * mode)))
            rows.append((group, prompt, min(response, max_response)))  # truncated at the cap
    return rows


def write_grpo(out_dir: Path) -> None:
    rows = generate_grpo()
    responses = [r for _, _, r in rows]
    summary = (
        f"mean response {statistics.mean(responses):.0f}, sd {statistics.pstdev(responses):.0f}, "
        f"{sum(r == 20_000 for r in responses) / len(rows):.1%} truncated at 20000"
    )
    header = [
        f"# GRPO rollouts like math RL: {len(rows)} responses, 8 per prompt (synthetic)",
        f"# made by data/generate_lengths.py (seed 5); {summary}",
    ]
    table = ["# group prompt_tokens response_tokens"] + [f"{g} {p} {r}" for g, p, r in rows]
    (out_dir / "grpo_math_like.tsv").write_text("\n".join(header + table) + "\n")
    totals = [str(p + r) for _, p, r in rows]
    (out_dir / "grpo_math_like.txt").write_text(
        "\n".join(header + ["# prompt + response tokens (rows of grpo_math_like.tsv)"] + totals)
        + "\n"
    )
    print(f"grpo_math_like: {summary}")


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
    if not names or "grpo_math_like" in names:
        write_grpo(out_dir)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])  # names of the files to write (default: all)
