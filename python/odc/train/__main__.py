"""`python -m odc.train`: the end-to-end SFT benchmark, collective FSDP2 vs ODC on variable-length
data. Starts one process per rank itself (odc.launch), prints a table, writes a JSON results file
and, with matplotlib, a PNG timeline of each rank's microbatches in one minibatch.

  python -m odc.train --lengths data/longalign_like.txt --compare            # all GPUs, 1.5b
  python -m odc.train --device cpu --ranks 4 --preset tiny --length-scale 0.0078125 --compare
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

COMBINATIONS = {
    "collective": ("local-sort", "lb-micro"),
    "odc": ("local-sort", "lb-micro", "lb-mini"),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m odc.train", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="sample lengths file (odc plan format): synthetic tokens")
    source.add_argument(
        "--jsonl", help='token ids, one JSON list (or {"input_ids": [...]}) per line'
    )
    parser.add_argument("--preset", choices=["tiny", "0.5b", "1.5b", "7b"])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, help="processes (default: all GPUs, or 4 on CPU)")
    parser.add_argument("--comm", choices=["collective", "odc"], default="odc")
    parser.add_argument(
        "--policy", choices=["local-sort", "lb-micro", "lb-mini"], default="lb-mini"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run collective + lb-micro and odc + lb-mini and compare them",
    )
    parser.add_argument(
        "--all", action="store_true", help="run all five comm x policy combinations"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="measured minibatches (after 1 warm-up)"
    )
    parser.add_argument("--samples-per-rank", type=int, default=4)
    parser.add_argument(
        "--max-tokens", type=int, help="token cap per microbatch (default: longest)"
    )
    parser.add_argument("--max-length", type=int, help="drop samples longer than this")
    parser.add_argument(
        "--constant-length",
        type=int,
        help="balanced control: every sample gets this length (as many samples as the file has)",
    )
    parser.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply lengths (small CPU runs)"
    )
    parser.add_argument(
        "--cost",
        default="fit",
        help="planner cost model A,B,C (C + sum(A*L + B*L^2) seconds per microbatch), or 'fit' "
        "(default): time single-sample microbatches on the model first and fit it; later runs "
        "of --compare/--all reuse the first run's fit, so their plans share one cost model",
    )
    parser.add_argument(
        "--split",
        choices=["off", "auto"],
        default="off",
        help="auto: run a sample costing more than a rank's share of its minibatch as chunks on "
        "a group of ranks (lb-mini, lb-micro); with --compare, runs collective + lb-micro, "
        "collective + lb-micro + split and odc + lb-mini + split",
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--output", default="odc_train_results.json")
    parser.add_argument("--timeline", default="odc_train_timeline.png")
    return parser.parse_args(argv)


def load_lengths(args) -> list:
    """Sample lengths from --lengths (read by the planner's C++ reader) or --jsonl, then scaled,
    filtered or replaced as the options say."""
    import odc

    from .data import load_token_ids

    try:
        if args.jsonl:
            lengths = [len(ids) for ids in load_token_ids(args.jsonl)]
        else:
            lengths = odc.read_lengths(args.lengths)
    except (OSError, ValueError) as error:
        sys.exit(f"odc train: {error}")
    lengths = [max(2, int(round(n * args.length_scale))) for n in lengths]
    if args.max_length:
        lengths = [n for n in lengths if n <= args.max_length]
    if args.constant_length:
        lengths = [args.constant_length] * len(lengths)
    if not lengths:
        sys.exit("odc train: no samples left (check --max-length)")
    if args.jsonl and (args.length_scale != 1.0 or args.max_length or args.constant_length):
        sys.exit("odc train: --length-scale, --max-length and --constant-length apply to --lengths")
    return lengths


def parse_cost(text: str):
    """'fit' -> None (fit on the model); 'A,B,C' -> (A, B, C), all finite and >= 0."""
    if text == "fit":
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0.0 <= v < float("inf") for v in values):
        sys.exit(
            f"odc train: --cost must be 'fit' or three non-negative numbers A,B,C, got '{text}'"
        )
    return values


def main(argv=None) -> int:
    args = parse_args(argv)
    cost = parse_cost(args.cost)
    import torch

    import odc

    from .run import RunConfig, default_store_path, run_rank

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ranks = args.ranks or (torch.cuda.device_count() if device == "cuda" else 4)
    preset = args.preset or ("1.5b" if device == "cuda" else "tiny")
    if ranks < 2:
        sys.exit(f"odc train: needs at least 2 ranks, got {ranks}")
    if args.comm == "collective" and args.policy == "lb-mini" and not (args.compare or args.all):
        sys.exit(
            "odc train: lb-mini gives ranks different microbatch counts, which collective FSDP2 "
            "cannot run: use --comm odc, or --policy lb-micro / local-sort"
        )
    if args.split == "auto" and args.policy == "local-sort" and not (args.compare or args.all):
        sys.exit("odc train: --split auto needs --policy lb-mini or lb-micro")
    lengths = load_lengths(args)
    max_tokens = args.max_tokens or max(lengths)
    if args.all:
        runs = [(c, p) for c, policies in COMBINATIONS.items() for p in policies]
    elif args.compare:
        runs = [("collective", "lb-micro"), ("odc", "lb-mini")]
    else:
        runs = [(args.comm, args.policy)]
    # (comm, policy, split): with --split auto, lb-micro and lb-mini split (issue #14), and
    # --compare adds the strongest collective baseline, collective + lb-micro + split.
    runs = [(c, p, args.split if p != "local-sort" else "off") for c, p in runs]
    if args.compare and args.split == "auto":
        runs = [("collective", "lb-micro", "off"), ("collective", "lb-micro", "auto")] + [
            ("odc", "lb-mini", "auto")
        ]

    results = []
    for comm, policy, split in runs:
        with tempfile.TemporaryDirectory() as directory:
            config = RunConfig(
                preset=preset,
                comm=comm,
                policy=policy,
                lengths=lengths,
                device=device,
                steps=args.steps,
                samples_per_rank=args.samples_per_rank,
                max_tokens=max_tokens,
                store_path=default_store_path(directory),
                lr=args.lr,
                activation_checkpointing=device == "cuda",
                cost=cost,
                token_ids_path=args.jsonl,
                split=split,
            )
            results.append(odc.launch(run_rank, ranks, config)[0])
            if len(results) > 1 and args.cost == "fit":
                first = f"{runs[0][0]} + {runs[0][1]}"
                results[-1]["cost_source"] = f"from the {first} run ({results[0]['cost_source']})"
            cost = tuple(results[-1]["cost"])  # one cost model for every run of this command

    print_table(results)
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"results: {args.output}")
    if args.timeline:
        written = write_timeline(results, args.timeline)
        print(f"timeline: {written}" if written else "timeline: skipped (matplotlib missing)")
    return 0


def print_table(results) -> None:
    base = results[0]["samples_per_second"]
    a, b, c = results[0]["cost"]
    print(
        f"\nplanner cost model ({results[0]['cost_source']}): "
        f"{c:.4g} s + {a:.4g} s x L + {b:.4g} s x L^2 per microbatch"
    )
    print(
        f"\n{'comm':10} {'policy':10} {'samples/s':>10} {'tokens/s':>11} {'step s':>8} "
        f"{'bubble':>7} {'predicted':>9} {'peak GiB':>9} {'vs first':>8}"
    )
    for r in results:
        label = r["policy"] + ("+split" if r.get("split") == "auto" else "")
        print(
            f"{r['comm']:10} {label:10} {r['samples_per_second']:10.2f} "
            f"{r['tokens_per_second']:11.0f} {r['step_seconds']:8.3f} {100 * r['bubble']:6.1f}% "
            f"{100 * r['predicted_bubble']:8.1f}% {r['peak_memory_bytes'] / 2**30:9.2f} "
            f"{r['samples_per_second'] / base:7.2f}x"
        )


def write_timeline(results, path: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(
        len(results), 1, figsize=(10, 1.2 + 0.5 * results[0]["ranks"] * len(results)), squeeze=False
    )
    colors = ("tab:blue", "tab:orange")
    for axis, result in zip(axes[:, 0], results):
        for rank, microbatches in enumerate(result["timeline"]):
            for index, (begin, end, _tokens) in enumerate(microbatches):
                axis.barh(rank, end - begin, left=begin, height=0.8, color=colors[index % 2])
        # The minibatch ends (optimizer step done) on the slowest rank: idle time lies before it.
        axis.axvline(result["last_span_seconds"], color="black", linestyle="--", linewidth=1)
        axis.set_title(
            f"{result['comm']} + {result['policy']}"
            f"{' + split' if result.get('split') == 'auto' else ''}: "
            "last minibatch, one bar per microbatch (a split chunk first)"
        )
        axis.set_ylabel("rank")
        axis.set_yticks(range(result["ranks"]))
        axis.set_xlabel("seconds since the minibatch started")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    sys.exit(main())
