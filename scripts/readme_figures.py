"""The README's generated figures: the planner block that `./scripts/main.sh` prints first (its
table rows from `odc compare`, and the sentence quoting two of its bubbles), between
`<!-- readme-figures:begin NAME -->` and `<!-- readme-figures:end NAME -->`. Every figure there
comes from running the planner, never from a hand edit, so the README cannot go stale without
tests/python/test_readme_figures.py failing. Only deterministic output belongs here (no timings).
Usage: python scripts/readme_figures.py [--odc PATH] [--readme FILE] [--write | --check]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The planner phase of scripts/main.sh (its first dataset): keep the two in step.
PLANNER_DATASET = "data/longalign_like.txt"
PLANNER_RANKS = 8
PLANNER_SAMPLES_PER_RANK = 4
PLANNER_MAX_TOKENS = 65536
COST_7B = "0.00027401178,0.0000000042464424,0"  # main.sh's cost_7b

BLOCK = re.compile(
    r"(?P<begin><!-- readme-figures:begin (?P<name>[\w-]+) [^\n]*-->\n)"
    r"(?P<body>.*?)"
    r"(?P<end><!-- readme-figures:end (?P=name) -->)",
    re.DOTALL,
)


def find_odc(explicit: str | None) -> str:
    """--odc, then $ODC_CLI, then this checkout's build, then beside this Python, then PATH."""
    candidates = [
        explicit,
        os.environ.get("ODC_CLI"),
        str(REPO / "build" / "cmake" / "odc"),
        str(Path(sys.executable).parent / "odc"),
        shutil.which("odc"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    sys.exit("readme_figures: the odc tool was not found: run scripts/build.sh or pass --odc PATH")


def run_compare(odc: str, output_format: str) -> str:
    command = [
        odc, "compare", "--lengths", str(REPO / PLANNER_DATASET), "--ranks", str(PLANNER_RANKS),
        "--samples-per-rank", str(PLANNER_SAMPLES_PER_RANK),
        "--max-tokens", str(PLANNER_MAX_TOKENS), "--cost", COST_7B, "--format", output_format,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"readme_figures: {' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def planner_block(odc: str) -> str:
    """The block's body: the table as main.sh prints it (header and policy rows; the decision
    and why lines that follow it are left out) and the sentence quoting its bubbles."""
    table = run_compare(odc, "table").splitlines()
    rows = []
    for line in table:
        if not line.strip() or line.startswith(("decision:", "why:")):
            break
        rows.append(line.rstrip())
    if len(rows) != 4 or not rows[0].startswith("policy"):
        sys.exit("readme_figures: odc compare's table changed shape:\n" + "\n".join(table))
    policies = {p["policy"]: p for p in json.loads(run_compare(odc, "json"))["policies"]}
    micro = 100 * policies["lb-micro"]["bubble"]["collective"]
    mini = 100 * policies["lb-mini"]["bubble"]["odc"]
    samples = PLANNER_RANKS * PLANNER_SAMPLES_PER_RANK
    title = (
        f"== {PLANNER_DATASET}: {PLANNER_RANKS} ranks, {samples} samples per minibatch, "
        f"max {PLANNER_MAX_TOKENS} tokens, 7B cost =="
    )
    return "\n".join(
        [
            "```",
            title,
            *rows,
            "```",
            "",
            f"LB-Micro under collective FSDP leaves {micro:.1f}% of GPU time idle; LB-Mini under "
            f"ODC leaves {mini:.1f}%",
            "(what remains is granularity: one 64K-token sample can outweigh a rank's whole share).",
            "",  # a blank line before the end marker
            "",
        ]
    )


GENERATORS = {"planner": planner_block}


def regenerate(text: str, odc: str) -> str:
    """`text` with every marked block's body replaced by its generator's output."""
    names = [match.group("name") for match in BLOCK.finditer(text)]
    unknown = sorted(set(names) - set(GENERATORS))
    if unknown:
        sys.exit(f"readme_figures: no generator for block(s) {', '.join(unknown)}")
    missing = sorted(set(GENERATORS) - set(names))
    if missing:
        sys.exit(
            f"readme_figures: the README lost its block(s) {', '.join(missing)}: restore the "
            "readme-figures:begin/end markers"
        )
    return BLOCK.sub(
        lambda m: m.group("begin") + GENERATORS[m.group("name")](odc) + m.group("end"), text
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--odc", help="the odc tool (default: $ODC_CLI, build/cmake/odc, PATH)")
    parser.add_argument("--readme", default=str(REPO / "README.md"), help="the file to update")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 where a block differs")
    args = parser.parse_args(argv)
    readme = Path(args.readme)
    current = readme.read_text()
    fresh = regenerate(current, find_odc(args.odc))
    if args.write:
        if fresh != current:
            readme.write_text(fresh)
        print(f"readme_figures: {readme} {'updated' if fresh != current else 'already current'}")
        return 0
    if args.check:
        if fresh == current:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), fresh.splitlines(), "README (as is)", "README (from the code)",
            lineterm="",
        )  # fmt: skip
        print(
            f"readme_figures: {readme}'s figures differ from what the code prints; run "
            "`python scripts/readme_figures.py --write`:\n" + "\n".join(diff),
            file=sys.stderr,
        )
        return 1
    sys.stdout.write(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
