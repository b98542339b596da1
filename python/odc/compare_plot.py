"""Draws `odc compare --plot FILE.png`: the predicted bubble of each policy under collective FSDP
and under ODC, and the predicted speedup over collective + LB-Micro. Reads the JSON of
`odc compare --format json` on stdin (the C++ tool pipes it here, so the tool links no Python).

  odc compare --lengths L --ranks 8 --max-tokens 65536 --format json | \
      python -m odc.compare_plot planner.png "my title"
"""

from __future__ import annotations

import sys

from ._plot_cli import draw_from_stdin


def draw(comparison: dict, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = comparison["policies"]
    names = [p["policy"] for p in policies]
    figure, (bubbles, speedups) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.38
    for offset, mode, color in (
        (-width / 2, "collective", "tab:gray"),
        (width / 2, "odc", "tab:blue"),
    ):
        for i, policy in enumerate(policies):
            value = policy["bubble"][mode]
            x = i + offset
            if value is None:  # lb-mini cannot run under collectives
                bubbles.text(x, 1, "n/a", ha="center", va="bottom", fontsize=8)
                continue
            bubbles.bar(x, 100 * value, width, color=color, label=mode if i == 0 else None)
            bubbles.text(x, 100 * value + 1, f"{100 * value:.1f}%", ha="center", fontsize=8)
    top = max(100 * v for p in policies for v in p["bubble"].values() if v is not None)
    bubbles.set_ylim(0, 1.15 * top + 2)
    bubbles.set_xticks(range(len(names)), names)
    bubbles.set_ylabel("predicted bubble (% of GPU time idle)")
    bubbles.set_title("bubble: lower is better")
    for offset, mode, color in (
        (-width / 2, "collective", "tab:gray"),
        (width / 2, "odc", "tab:blue"),
    ):
        for i, policy in enumerate(policies):
            value = policy["speedup"][mode]
            if value is None:
                speedups.text(i + offset, 0.02, "n/a", ha="center", va="bottom", fontsize=8)
                continue
            speedups.bar(i + offset, value, width, color=color, label=mode if i == 0 else None)
            speedups.text(i + offset, value + 0.01, f"{value:.2f}x", ha="center", fontsize=8)
    fastest = max(v for p in policies for v in p["speedup"].values() if v is not None)
    speedups.set_ylim(0, 1.15 * max(fastest, 1.0))
    speedups.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    speedups.set_xticks(range(len(names)), names)
    speedups.set_ylabel(f"predicted speedup vs {comparison['baseline']}")
    speedups.set_title("speedup: higher is better")
    figure.suptitle(title or "odc compare", fontsize=10)
    # One legend for both panels, below them: never over a bar (the bars differ by colour only).
    handles, labels = bubbles.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "python -m odc.compare_plot FILE.png [TITLE] < compare.json"
    return draw_from_stdin("odc.compare_plot", usage, "compare", "policies", draw, argv)


if __name__ == "__main__":
    sys.exit(main())
