"""`python -m odc.train`: the end-to-end SFT benchmark, collective FSDP2 vs ODC on variable-length
data. Starts one process per rank itself (odc.launch), or runs as the ranks torchrun started;
prints a table, writes a JSON results file and, with matplotlib, a PNG timeline of each rank's
microbatches in one minibatch.

  python -m odc.train --lengths data/longalign_like.txt --compare            # all GPUs, 1.5b
  torchrun --nproc_per_node 4 -m odc.train --lengths data/longalign_like.txt --compare
  python -m odc.train --device cpu --ranks 4 --preset tiny --length-scale 0.0078125 --compare
  python -m odc.train --lengths data/longalign_like.txt --mesh 2,2 --compare   # hybrid (HSDP)
  python -m odc.train --lengths data/longalign_like.txt --baselines   # ODC vs 4 FSDP2 baselines

Results go into a new run directory (default runs/<UTC time>/: results.json, timeline.png); an
existing file is never overwritten. Usage errors exit with status 2 and one line, like `odc`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .matrix import RunSpec, UsageError, run_matrix, usage_error
from .._numbers import finite_number, option_type, whole_number

PROG = "python -m odc.train"
USAGE_ERROR = 2

# The longest sample a CPU run takes: the tiny preset trains a 4K-token sample in seconds on a
# few cores; GPU-sized lengths (up to 64K) would run for many minutes per step.
CPU_MAX_TOKENS = 4096


# The most ranks one command may ask for: the planner's limit (kMaxRanks, src/planner/plan.h).
MAX_RANKS = 65536


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage block
        raise UsageError(f"{message} (see --help)")


def _nonempty(text: str) -> str:
    """A path or value that must not be empty: '' would otherwise read as "not given"."""
    if not text:
        raise ValueError("expected a value, got '' (leave the option out for its default)")
    return text


_COUNT = option_type(whole_number)  # every integer option
_NUMBER = option_type(finite_number)  # every float option
_TEXT = option_type(_nonempty)  # paths and lists that have no meaning when empty


def parse_args(argv):
    """The options, added in the order --help lists them."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    _add_data_and_machine(parser)
    _add_run_choice(parser)
    _add_workload(parser)
    _add_layout(parser)
    _add_training_and_outputs(parser)
    return parser.parse_args(argv)


def _add_data_and_machine(parser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--lengths", type=_TEXT, help="sample lengths file (odc plan format): synthetic tokens"
    )
    source.add_argument(
        "--jsonl", type=_TEXT, help='token ids, one JSON list (or {"input_ids": [...]}) per line'
    )
    source.add_argument(
        "--rollouts",
        type=_TEXT,
        help="GRPO rollouts, 'group prompt_tokens response_tokens' per line "
        "(data/grpo_math_like.tsv): --task grpo, synthetic tokens",
    )
    parser.add_argument(
        "--task",
        choices=["sft", "grpo"],
        default="sft",
        help="sft (default): next-token loss on every token; grpo: GRPO's training phase per RL "
        "step (old and reference log-probs forward only, then the actor update over "
        "--minibatches-per-step minibatches; docs/train.md)",
    )
    parser.add_argument(
        "--prompts-per-step", type=_COUNT, default=8, help="grpo: groups per RL step"
    )
    parser.add_argument(
        "--minibatches-per-step", type=_COUNT, default=2, help="grpo: actor-update minibatches (K)"
    )
    parser.add_argument(
        "--kl-coef", type=_NUMBER, default=0.0, help="grpo: weight of the KL to the reference"
    )
    parser.add_argument("--preset", choices=["tiny", "0.5b", "1.5b", "7b"])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=_COUNT, help="processes (default: all GPUs, or 4 on CPU)")


def _add_run_choice(parser) -> None:
    """Which runs: one comm x policy (an arm: docs/train.md "Arms"), or --compare / --baselines
    / --all (matrix.run_matrix)."""
    parser.add_argument(
        "--comm",
        choices=["collective", "fsdp2-deferred", "fsdp2-unsharded", "odc"],
        default="odc",
        help="collective (FSDP2), fsdp2-deferred (FSDP2, gradient sync deferred to the last "
        "microbatch), fsdp2-unsharded (FSDP2, resharding off and sync deferred: unequal "
        "microbatch counts, unsharded parameters and gradients) or odc (default)",
    )
    parser.add_argument(
        "--policy",
        choices=["local-sort", "lb-micro", "lb-mini", "lb-mini-padded"],
        default="lb-mini",
        help="the planner's policy; lb-mini-padded: LB-Mini's plan, every rank padded to the "
        "largest microbatch count with empty microbatches (runs under any --comm)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run collective + lb-micro and odc + lb-mini and compare them",
    )
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="run odc + lb-mini against the four FSDP2 baselines: collective + lb-micro, "
        "fsdp2-deferred + lb-micro, fsdp2-unsharded + lb-mini, collective + lb-mini-padded",
    )
    parser.add_argument(
        "--all", action="store_true", help="run all eight comm x policy combinations"
    )


def _add_workload(parser) -> None:
    """How many minibatches of which samples, and the planner's cost model."""
    parser.add_argument(
        "--steps", type=_COUNT, default=4, help="measured minibatches (after 1 warm-up)"
    )
    parser.add_argument("--samples-per-rank", type=_COUNT, default=4)
    parser.add_argument(
        "--max-tokens", type=_COUNT, help="token cap per microbatch (default: longest)"
    )
    parser.add_argument("--max-length", type=_COUNT, help="drop samples longer than this")
    parser.add_argument(
        "--constant-length",
        type=_COUNT,
        help="balanced control: every sample gets this length (as many samples as the file has)",
    )
    parser.add_argument(
        "--length-scale", type=_NUMBER, default=1.0, help="multiply lengths (small CPU runs)"
    )
    parser.add_argument(
        "--cost",
        type=_TEXT,
        default="fit",
        help="planner cost model A,B,C (C + sum(A*L + B*L^2) seconds per microbatch) or "
        "A,B,C,F (at least F seconds per microbatch: the host-bound floor), or 'fit' "
        "(default): time single-sample and packed microbatches on the model first and fit it, "
        "floor included; later runs of --compare/--all reuse the first run's fit, so their plans "
        "share one cost model",
    )


def _add_layout(parser) -> None:
    """How the ranks are arranged and share work: mesh, split samples, microbatch memory."""
    parser.add_argument(
        "--mesh",
        type=_TEXT,
        help="R,S: FSDP2 HSDP mesh of R replicas x S ranks (ODC inside each replica, one "
        "all-reduce across replicas per minibatch; R*S ranks). --compare on a 2-D mesh also runs "
        "flat ODC (1 x R*S). Default: flat, a 1-D mesh over all ranks",
    )
    parser.add_argument(
        "--split",
        choices=["off", "auto"],
        default="off",
        help="auto: run a sample costing more than a rank's share of its minibatch as chunks on "
        "a group of ranks (lb-mini, lb-micro); with --compare, runs collective + lb-micro, "
        "collective + lb-micro + split and odc + lb-mini + split",
    )
    parser.add_argument(
        "--kv-exchange",
        choices=["auto", "nccl", "odc", "both"],
        default="auto",
        help="how a split group exchanges K/V: nccl (an all-gather in an NCCL subgroup; gloo on "
        "the CPU), odc (pulls from odc symmetric buffers; ODC runs only: collective runs use "
        "nccl), both (every ODC + split run twice, once with each), or auto (default): odc for "
        "ODC runs on a flat mesh (measured faster on 4 H200s), nccl for the others",
    )
    parser.add_argument(
        "--steal",
        choices=["off", "on", "both"],
        default="off",
        help="work stealing in ODC runs: a rank that ran out of planned microbatches takes the "
        "last one of the rank with the most predicted work left (OdcFSDP.microbatches); both: "
        "every ODC run twice, without and with (the table shows the microbatches moved). "
        "Default off",
    )
    parser.add_argument(
        "--rank-slowdown",
        type=_TEXT,
        action="append",
        metavar="RANK:FACTOR",
        help="make rank RANK FACTOR times slower (>= 1; repeatable): after each of its "
        "microbatches it waits for its GPU and sleeps (FACTOR - 1) x the microbatch's time, "
        "inside the microbatch's timing. Unplanned (the planner assumes equal speeds): what "
        "stealing corrects",
    )
    parser.add_argument(
        "--microbatch-memory",
        choices=["lb-micro", "cap"],
        default="lb-micro",
        help="how large lb-mini may make a microbatch: lb-micro (no larger than the largest "
        "lb-micro builds for the same minibatch, so no more activation memory than collective + "
        "lb-micro) or cap (up to --max-tokens: the fastest predicted plan, more memory)",
    )


def _add_training_and_outputs(parser) -> None:
    parser.add_argument("--lr", type=_NUMBER, default=1e-4)
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "adamw-fused"],
        default="adamw",
        help="adamw (torch's default AdamW: foreach kernels on GPUs) or adamw-fused "
        "(fused=True: fewer kernel launches per step; every run of the command uses it)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each decoder block (torch.compile, dynamic token count), every arm "
        "alike; on by default on GPUs without --split (the CPU always runs the blocks "
        "eagerly); --no-compile: eager PyTorch, the old host floor, for side-by-side runs. "
        "The first microbatches of a process compile (tens of seconds, cached on disk)",
    )
    parser.add_argument(
        "--profile",
        type=_TEXT,
        metavar="DIR",
        help="after the measured minibatches, run the last one again under torch.profiler and "
        "write, per run and rank, a Chrome trace (DIR/<run>_rank<r>.json.gz) and a table of "
        "the operators with the most self time (.txt); the results do not include it",
    )
    parser.add_argument(
        "--run-dir",
        type=_TEXT,
        help="directory for this run's files (default: a new runs/<UTC time>/); may exist, but "
        "files in it are never overwritten",
    )
    parser.add_argument("--output", type=_TEXT, help="results JSON (default: RUN_DIR/results.json)")
    parser.add_argument(
        "--timeline", help="timeline PNG (default: RUN_DIR/timeline.png; '' for none)"
    )


def output_paths(args):
    """(results path, timeline path or None): explicit paths as given, others in the run
    directory; refuses any that exists, so no earlier result is silently overwritten."""
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is None and (args.output is None or args.timeline is None):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_dir = Path("runs") / stamp
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = Path("runs") / f"{stamp}-{suffix}"
    output = Path(args.output) if args.output else run_dir / "results.json"
    if args.timeline == "":
        timeline = None
    else:
        timeline = Path(args.timeline) if args.timeline else run_dir / "timeline.png"
    for path in (output, timeline):
        if path is not None and path.exists():
            usage_error(f"{path} exists: choose another --output/--timeline/--run-dir or remove it")
    return output, timeline


def load_lengths(args, vocab_size=None) -> list:
    """Sample lengths from --lengths (read by the planner's C++ reader) or --jsonl (token ids
    below `vocab_size`, the preset's: checked here, before any rank starts), then scaled,
    filtered or replaced as the options say."""
    import odc

    from .data import load_token_ids

    if args.rollouts:
        return [r.length for r in load_rollouts(args)]
    try:
        if args.jsonl:
            lengths = [len(ids) for ids in load_token_ids(args.jsonl, vocab_size)]
        else:
            lengths = odc.read_lengths(args.lengths)
    except (OSError, ValueError) as error:
        usage_error(str(error))
    lengths = [max(2, int(round(n * args.length_scale))) for n in lengths]
    if args.max_length:
        lengths = [n for n in lengths if n <= args.max_length]
    if args.constant_length:
        lengths = [args.constant_length] * len(lengths)
    if not lengths:
        usage_error("no samples left (check --max-length)")
    if args.jsonl and (args.length_scale != 1.0 or args.max_length or args.constant_length):
        usage_error("--length-scale, --max-length and --constant-length apply to --lengths")
    return lengths


def load_rollouts(args) -> list:
    """--rollouts, each prompt and response scaled by --length-scale (at least 1 token each);
    read once (the checks before torch is imported read it first) and kept in `args`."""
    from .grpo import Rollout, read_rollouts

    if getattr(args, "scaled_rollouts", None) is not None:
        return args.scaled_rollouts
    try:
        rollouts = read_rollouts(args.rollouts)
    except OSError as error:
        usage_error(f"--rollouts {args.rollouts}: {error.strerror or error}")
    except ValueError as error:
        usage_error(str(error))
    if args.max_length or args.constant_length:
        usage_error("--max-length and --constant-length apply to --lengths (groups stay whole)")
    scale = args.length_scale
    args.scaled_rollouts = [
        Rollout(
            r.group,
            max(1, int(round(r.prompt_tokens * scale))),
            max(1, int(round(r.response_tokens * scale))),
        )
        for r in rollouts
    ]
    return args.scaled_rollouts


def parse_cost(text: str):
    """'fit' -> None (fit on the model); 'A,B,C' -> (A, B, C, 0); 'A,B,C,F' -> (A, B, C, F);
    all finite and >= 0."""
    if text == "fit":
        return None
    try:
        values = tuple(finite_number(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (3, 4) or not all(v >= 0.0 for v in values):
        usage_error(
            "--cost must be 'fit' or three non-negative numbers A,B,C (or four, A,B,C,F, with "
            f"a floor F), got '{text}'"
        )
    return values if len(values) == 4 else (*values, 0.0)


def parse_rank_slowdown(texts, ranks: int) -> dict:
    """['RANK:FACTOR', ...] -> {rank: factor}, rank < ranks, factor >= 1 (finite)."""
    slowdown = {}
    for text in texts or ():
        try:
            rank_text, factor_text = text.split(":")
            rank, factor = whole_number(rank_text), finite_number(factor_text)
        except ValueError:
            usage_error(f"--rank-slowdown must be RANK:FACTOR (e.g. 1:1.3), got '{text}'")
        if not 0 <= rank < ranks:
            usage_error(f"--rank-slowdown {text}: rank {rank} is not one of the {ranks} ranks")
        if factor < 1.0:
            usage_error(f"--rank-slowdown {text}: FACTOR must be >= 1 (1: not slowed)")
        if rank in slowdown:
            usage_error(f"--rank-slowdown names rank {rank} twice")
        slowdown[rank] = factor
    return slowdown


def parse_mesh(text):
    """'R,S' -> (R, S), R >= 1 replicas of S >= 2 ranks; None without --mesh."""
    if text is None:
        return None
    try:
        replicas, shards = (whole_number(v) for v in text.split(","))
    except ValueError:
        usage_error(f"--mesh must be R,S (replicas, ranks per replica), got '{text}'")
    if replicas < 1 or shards < 2:
        usage_error(f"--mesh {text}: needs R >= 1 replicas of S >= 2 ranks (ODC inside)")
    return replicas, shards


def main(argv=None) -> int:
    try:
        return _main(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_ERROR


def _check_cpu_sized(preset: str, lengths, max_tokens: int) -> None:
    """Refuses GPU-sized work on the CPU, saying how to scale it down."""
    if preset != "tiny":
        usage_error(
            f"the {preset} preset is GPU-sized and no GPU is used: on the CPU use --preset tiny"
        )
    longest = max(max(lengths), max_tokens)
    if longest > CPU_MAX_TOKENS:
        scale = 2.0 ** math.floor(math.log2(CPU_MAX_TOKENS / longest))
        usage_error(
            f"samples or microbatches of up to {longest} tokens are GPU-sized; a CPU run takes "
            f"at most {CPU_MAX_TOKENS}: add --length-scale {scale:g} (or --max-length / "
            "--max-tokens)"
        )


def _main(argv) -> int:
    args = parse_args(argv)
    cost = parse_cost(args.cost)
    mesh = _check_options(args, cost)
    # The runs, and the combinations refused, before torch is imported or a rank starts.
    runs = run_matrix(
        comm=args.comm,
        policy=args.policy,
        compare=args.compare,
        all_runs=args.all,
        baselines=args.baselines,
        split=args.split,
        kv_exchange=args.kv_exchange,
        mesh=mesh,
        transport=os.environ.get("ODC_TRANSPORT"),
        steal=args.steal,
    )
    try:
        import torch
    except ImportError:
        print(f"{PROG}: error: needs PyTorch: pip install 'odc[train]'", file=sys.stderr)
        return 1

    from .launching import Launcher

    device = _choose_device(args, torch)
    launcher = Launcher(device)
    ranks, preset = _ranks_and_preset(args, launcher, device, torch)
    args.rank_slowdown_by_rank = parse_rank_slowdown(args.rank_slowdown, ranks)
    from .model import PRESETS

    lengths = load_lengths(args, PRESETS[preset]["vocab_size"])
    _check_samples(args, cost, lengths)
    max_tokens = args.max_tokens or max(lengths)
    if device == "cpu":
        _check_cpu_sized(preset, lengths, max_tokens)
    output, timeline = output_paths(args)
    if args.profile and any(Path(args.profile).glob("*_rank*.json.gz")):
        usage_error(f"{args.profile} already holds profiles: choose another --profile directory")
    setup = dict(preset=preset, device=device, lengths=lengths, max_tokens=max_tokens)
    results = _run_all(args, runs, launcher, ranks, cost, setup)
    if launcher.reports:
        _report(results, output, timeline)
    return 0


def _check_options(args, cost):
    """Checks the options that need no torch; returns the HSDP mesh (replicas, shards), or None
    for a flat one (no --mesh, or one replica). --mesh without --ranks sets args.ranks."""
    mesh = parse_mesh(args.mesh)
    if mesh is not None:
        if args.ranks is None:
            args.ranks = mesh[0] * mesh[1]
        elif mesh[0] * mesh[1] != args.ranks:
            usage_error(f"--mesh {args.mesh} covers {mesh[0] * mesh[1]} ranks, not {args.ranks}")
        if mesh[0] == 1:
            mesh = None  # one replica: the flat 1-D mesh
    if args.ranks is not None and args.ranks < 2:
        usage_error(f"needs at least 2 ranks, got {args.ranks}")
    if args.ranks is not None and args.ranks > MAX_RANKS:
        usage_error(f"--ranks {args.ranks}: the planner plans at most {MAX_RANKS} ranks")
    for name in ("steps", "samples_per_rank", "max_tokens", "max_length", "constant_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            usage_error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not args.length_scale > 0:
        usage_error(f"--length-scale must be positive, got {args.length_scale}")
    if args.lr < 0:
        usage_error(f"--lr must be >= 0, got {args.lr}")
    _check_task(args, cost)
    return mesh


def _check_samples(args, cost, lengths) -> None:
    """What the ranks' planner would refuse, refused before any rank starts: a sample longer
    than --max-tokens, or a --cost whose total over the samples is not a finite number."""
    longest = max(lengths)
    if args.max_tokens is not None and args.max_tokens < longest:
        scaled = " after --length-scale" if args.length_scale != 1.0 else ""
        usage_error(
            f"--max-tokens {args.max_tokens} is below the longest sample ({longest} tokens"
            f"{scaled}): every sample must fit in one microbatch"
        )
    if cost is None:
        return
    a, b, c, floor = cost
    total = 0.0
    for index, length in enumerate(lengths):  # summed as the planner sums it (plan.cc)
        total += a * length + b * float(length) * length + c + floor
        if not math.isfinite(total):
            usage_error(
                f"--cost {args.cost} overflows: the samples' cost is infinite by sample {index} "
                f"({length} tokens); scale the coefficients down"
            )


def _check_task(args, cost) -> None:
    """--task grpo takes --rollouts (and --rollouts takes --task grpo) and its own options;
    the rollouts are read and checked here, before torch is imported."""
    if (args.task == "grpo") != bool(args.rollouts):
        usage_error("--task grpo reads --rollouts (and --rollouts is for --task grpo)")
    if args.compile and args.split != "off":
        # The split's K/V exchange (collectives, odc calls) would run inside compiled blocks,
        # which no GPU run has covered yet.
        usage_error("--compile does not run with --split yet: drop one of them")
    if args.compile is None:  # the default: compiled blocks wherever they can run
        args.compile = args.split == "off"
    if args.task != "grpo":
        return
    if args.split != "off":
        usage_error("--task grpo does not split samples yet: drop --split")
    for name in ("prompts_per_step", "minibatches_per_step"):
        if getattr(args, name) < 1:
            usage_error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompts_per_step % args.minibatches_per_step:
        usage_error("--prompts-per-step must be a multiple of --minibatches-per-step")
    if args.kl_coef < 0:
        usage_error(f"--kl-coef must be >= 0, got {args.kl_coef}")
    rollouts = load_rollouts(args)
    _check_samples(args, cost, [r.length for r in rollouts])
    _check_rl_steps(args, rollouts)


def _check_rl_steps(args, rollouts) -> None:
    """The rollouts hold a warm-up RL step and at least one measured one, and every step the run
    takes splits into --minibatches-per-step minibatches of equal sizes."""
    from .grpo import rl_steps
    from .run import RunConfig

    steps = rl_steps(rollouts, args.prompts_per_step, args.minibatches_per_step)
    needed = RunConfig.warmup_steps + 1
    if len(steps) < needed:
        groups = len({r.group for r in rollouts})
        usage_error(
            f"--rollouts {args.rollouts} holds {groups} groups, {len(steps)} RL step(s) of "
            f"--prompts-per-step {args.prompts_per_step}; a run needs {needed} "
            f"({RunConfig.warmup_steps} warm-up): lower --prompts-per-step or add rollouts"
        )
    for number, minibatches in enumerate(steps[: args.steps + RunConfig.warmup_steps], start=1):
        sizes = sorted({len(minibatch) for minibatch in minibatches})
        if len(sizes) > 1:
            usage_error(
                f"--rollouts {args.rollouts}: RL step {number}'s minibatches hold "
                f"{' and '.join(map(str, sizes))} rollouts: every group needs the same number "
                "of responses"
            )


def _choose_device(args, torch) -> str:
    """--device, or cuda where torch sees a GPU and the CPU otherwise."""
    if args.device == "cuda" and not torch.cuda.is_available():
        usage_error("--device cuda, but torch sees no GPU")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _ranks_and_preset(args, launcher, device: str, torch):
    """(ranks, preset): torchrun's world, --ranks, or every GPU (4 processes on the CPU); the
    preset sized for the device unless --preset names one. Says which device a default chose."""
    if launcher.torchrun and args.ranks not in (None, launcher.world_size):
        usage_error(f"--ranks {args.ranks}, but torchrun started {launcher.world_size}")
    if args.device is None and launcher.reports:
        print(
            f"{PROG}: "
            + (
                f"{torch.cuda.device_count()} GPU(s) found: running on them"
                if device == "cuda"
                else "no GPU found: running on the CPU"
            ),
            file=sys.stderr,
        )
    ranks = (
        launcher.world_size or args.ranks or (torch.cuda.device_count() if device == "cuda" else 4)
    )
    preset = args.preset or ("1.5b" if device == "cuda" else "tiny")
    if ranks < 2:
        usage_error(f"needs at least 2 ranks, and torch sees {ranks} GPU(s): add --device cpu")
    return ranks, preset


def _run_all(args, runs, launcher, ranks: int, cost, setup: dict) -> list:
    """Rank 0's summary of each run, in order. `cost` (None: fit) plans the first run; its cost
    model, fitted or given, plans every later one, so their plans share one model."""
    results = []
    launcher.start()
    for index, spec in enumerate(runs):
        if launcher.reports:
            print(
                f"{PROG}: run {index + 1}/{len(runs)}: {spec.label}, {ranks} ranks on "
                f"{setup['device']}, {setup['preset']} preset; starting the ranks and building "
                "the model",
                file=sys.stderr,
                flush=True,
            )
        results.append(launcher.run(_run_config(args, spec, cost, **setup), ranks, _rl(args)))
        if len(results) > 1 and args.cost == "fit":
            first = f"{runs[0].comm} + {runs[0].policy}"
            results[-1]["cost_source"] = f"from the {first} run ({results[0]['cost_source']})"
        cost = tuple(results[-1]["cost"])  # one cost model for every run of this command
    launcher.close()
    return results


def _rl(args):
    """GRPO's settings for --task grpo (None for SFT)."""
    if args.task != "grpo":
        return None
    from .grpo_run import RlConfig

    return RlConfig(
        load_rollouts(args),
        prompts_per_step=args.prompts_per_step,
        minibatches_per_step=args.minibatches_per_step,
        kl_coef=args.kl_coef,
    )


def _run_config(args, spec: RunSpec, cost, *, preset, device, lengths, max_tokens):
    """The RunConfig of one run of the matrix: its spec, and what every run of the command shares."""
    from .run import RunConfig

    return RunConfig(
        preset=preset,
        comm=spec.comm,
        policy=spec.policy,
        lengths=lengths,
        device=device,
        steps=args.steps,
        samples_per_rank=args.samples_per_rank,
        max_tokens=max_tokens,
        store_path="",  # set by the launcher when it starts the ranks itself
        lr=args.lr,
        activation_checkpointing=device == "cuda",
        cost=cost,
        token_ids_path=args.jsonl,
        mesh=spec.mesh,
        split=spec.split,
        kv_exchange=spec.kv_exchange,
        microbatch_memory=args.microbatch_memory,
        optimizer=args.optimizer,
        compile_blocks=args.compile,
        profile_dir=args.profile,
        steal=spec.steal,
        rank_slowdown=args.rank_slowdown_by_rank,
    )


def _report(results, output: Path, timeline) -> None:
    """Rank 0's report: the tables, the results JSON and the timeline PNG (None: none)."""
    print_table(results)
    print_mesh_table(results)
    print_rl_phases(results)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print(f"results: {output}")
    if timeline is not None:
        timeline.parent.mkdir(parents=True, exist_ok=True)
        written = write_timeline(results, str(timeline))
        print(f"timeline: {written}" if written else "timeline: skipped (matplotlib missing)")


def print_rl_phases(results) -> None:
    """GRPO runs: the forward-only phases per RL step (slowest rank, mean over the measured RL
    steps), which the table's step times (update minibatches) leave out, beside the planner's
    prediction for the same plans (one forward-only minibatch each: policy and reference)."""
    rl_runs = [r for r in results if r.get("task") == "grpo"]
    if not rl_runs:
        return
    from .table import format_table

    print("\nGRPO forward-only phases per RL step, slowest rank, s (mean over measured steps):")
    header = ["run", "old logprobs", "reference", "predicted", "exchanges", "entropy"]
    rows = []
    for result in rl_runs:
        rl = result["rl"]
        first = result.get("warmup_steps", 0) // rl["minibatches_per_step"]
        phases = rl["phase_seconds"][first:] or rl["phase_seconds"]
        mean = lambda key: sum(p[key] for p in phases) / len(phases)  # noqa: E731
        exchanges = mean("old_logprobs_exchange") + mean("ref_logprobs_exchange")
        predicted = rl.get("predicted_phase_seconds", [])[first:][: len(phases)]
        rows.append(
            [
                result["comm"] + " + " + _run_label(result),
                f"{mean('old_logprobs'):.3f}",
                f"{mean('ref_logprobs'):.3f}",
                f"{sum(predicted) / len(predicted):.3f}" if predicted else "n/a",
                f"{exchanges:.3f}",
                f"{rl['entropy'][-1]:.3f}",
            ]
        )
    print("\n".join(format_table(header, rows, "lrrrrr", indent="  ")))


def _spread(values) -> str:
    """'min / median / max' of per-minibatch values."""
    import numpy as np

    return f"{min(values):.3f} / {float(np.median(values)):.3f} / {max(values):.3f}"


def _loss_verdict(results) -> str:
    """One line: do the runs' per-minibatch losses and gradient norms (before clipping) agree?
    They should: the same data and initial weights, and gradients summed the same way whatever
    the communication or the plan. A value that is not finite, or a run that recorded fewer
    values (or none where another did), is a difference."""
    first = results[0]
    tolerance = 1e-4 if first["device"] == "cpu" else 2e-2  # fp32 on the CPU; bf16 on GPUs
    steps = len(first["losses"])
    if len(results) < 2:
        return f"losses: {steps} minibatches, last {first['losses'][-1]:.4f} (one run, nothing to compare)"
    worst = {key: _worst_difference(results, key) for key in ("losses", "grad_norms")}
    differences = (
        f"max relative difference {worst['losses']:.1e} in losses, {worst['grad_norms']:.1e} in "
        f"gradient norms over {steps} minibatches, tolerance {tolerance:g}"
    )
    if max(worst.values()) <= tolerance:
        return (
            f"losses: AGREE across the {len(results)} runs ({differences}): all runs train the "
            "same model"
        )
    return (
        f"losses: DIFFER across runs ({differences}): the modes did not compute the same "
        "gradients"
    )


def _worst_difference(results, key: str) -> float:
    """The largest relative difference of `key`'s values between the first run and any other:
    inf for a value that is not finite or values missing on one side. Where the first run's
    values cross zero (GRPO's advantage-weighted losses), relative to their mean magnitude near
    zero, where a plain relative difference is noise."""
    import math

    runs = [r.get(key) for r in results]
    if all(values is None for values in runs):
        return 0.0  # recorded by none of the runs (results of an older odc.train)
    if any(values is None or len(values) != len(runs[0]) for values in runs):
        return math.inf
    if not all(math.isfinite(v) for values in runs for v in values):
        return math.inf
    first = runs[0]
    crosses_zero = min(first, default=0.0) < 0.0 < max(first, default=0.0)
    scale = sum(abs(v) for v in first) / max(len(first), 1) if crosses_zero else 0.0
    worst = 0.0
    for values in runs[1:]:
        for a, b in zip(first, values):
            worst = max(worst, abs(a - b) / max(abs(a), scale, 1e-12))
    return worst


def _run_label(result) -> str:
    """The policy column: lb-mini, lb-mini+split, and +split/odc where K/V went through odc."""
    label = result["policy"]
    if result.get("split") == "auto":
        label += "+split" + ("/odc" if result.get("kv_exchange") == "odc" else "")
    if result.get("steal"):
        label += "+steal"
    return label


def print_table(results) -> None:
    """The comparison table of the runs, the first one the baseline, then the loss and speedup
    verdicts, a legend and every run's predicted / measured span per minibatch. On the CPU what
    the run checked (the losses) comes first, with a plain word that its timings are not GPU
    figures: the ranks share the machine's cores, so a speedup there is no result."""
    from .metrics import describe_cost

    base = results[0]
    on_cpu = base["device"] == "cpu"
    if on_cpu:
        print("\nwhat this CPU run checked:")
        print(f"  {_loss_verdict(results)}")
        print(f"  {_cpu_timing_note(base)}")
    print(
        f"\nplanner cost model ({base['cost_source']}): {describe_cost(base['cost'])} per "
        "microbatch"
    )
    verdicts = _print_runs(results)
    for r in results:
        if r.get("steal"):
            print(
                f"{r['comm']} + {_run_label(r)}: {r['microbatches_moved']} of "
                f"{r['microbatches_run']} microbatches ran on a rank other than the planned one "
                "(work stealing)"
            )
    warning = _cost_unit_warning(results)
    if warning:
        print(warning)
    below = ([] if on_cpu else [_loss_verdict(results)]) + [f"speedup: {v}" for v in verdicts]
    if below:
        print("\n" + "\n".join(below))
    _print_legend(base)
    _print_per_minibatch(results)


def _cpu_timing_note(base) -> str:
    """What the timings of a CPU run are (and are not)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"timings: NOT GPU figures. The {base['ranks']} ranks are processes sharing this "
        f"machine's {cores} CPU core(s),\n  so the seconds, bubbles and speedups below measure "
        "their contention as much as the method\n  (a speedup under 1.00x here says nothing "
        "about GPUs; GPU results: docs/benchmarks.md)"
    )


def _print_runs(results) -> list:
    """One row per run; returns the speedup verdicts (runs within the machine's noise)."""
    from .table import format_table, signed_percent

    base = results[0]
    spans_known = all(r.get("minibatch_seconds") for r in results)
    header = ["comm", "policy", "samples/s", "tokens/s"]
    header += ["step s min / median / max" if spans_known else "step s", "pred s", "err"]
    header += ["bubble", "predicted", "peak GiB", "speedup"]
    rows, verdicts = [], []
    for r in results:
        # Under collective, waits inside FSDP2's collectives count as busy: idle is not measured.
        measured = f"{100 * r['bubble']:.1f}%" if r.get("bubble_measured", True) else "n/a"
        predicted_step = r["predicted_seconds"] / r["minibatches"]
        steps = _spread(r["minibatch_seconds"]) if spans_known else f"{r['step_seconds']:.3f}"
        # The CPU has no peak-memory counter that means the same as the GPU's: not measured.
        peak = "n/a" if r["device"] == "cpu" else f"{r['peak_memory_bytes'] / 2**30:.2f}"
        speedup, verdict = _speedup(r, base, spans_known)
        if verdict:
            verdicts.append(verdict)
        rows.append(
            [
                r["comm"],
                _run_label(r),
                f"{r['samples_per_second']:.2f}",
                f"{r['tokens_per_second']:.0f}",
                steps,
                f"{predicted_step:.3f}",
                signed_percent(r["span_error"]),
                measured,
                f"{100 * r['predicted_bubble']:.1f}%",
                peak,
                speedup,
            ]
        )
    print()
    print("\n".join(format_table(header, rows, "llrrrrrrrrl")))
    return verdicts


def _cost_unit_warning(results):
    """A line for a given --cost whose predictions are far from the measured seconds (its
    coefficients are in another unit, or from another machine), else None: pred s and err then
    compare numbers that do not mean the same thing."""
    if results[0].get("cost_source") != "given":
        return None
    worst = max(results, key=lambda r: abs(r["span_error"]))
    ratio = 1.0 + worst["span_error"]
    if 0.5 <= ratio <= 2.0:
        return None
    return (
        f"note: the given --cost predicts {ratio:.3g}x the measured seconds per minibatch "
        f"({worst['comm']} + {_run_label(worst)}): its coefficients are not seconds on this "
        "machine, so pred s and err say nothing here; leave --cost out (the default, 'fit', "
        "fits one on this machine first) or pass one fitted here"
    )


def _speedup(r, base, spans_known: bool):
    """(the speedup column against the baseline, a verdict when it is within the noise or None)."""
    ratio = r["samples_per_second"] / base["samples_per_second"]
    if r is base:
        return "1.00x (baseline)", None
    if not (spans_known and len(r["minibatch_seconds"]) == len(base["minibatch_seconds"])):
        return f"{ratio:.2f}x", None
    # The same minibatches (same samples) ran in both: per-minibatch ratios give a spread.
    each = [x / y for x, y in zip(base["minibatch_seconds"], r["minibatch_seconds"])]
    speedup = f"{ratio:.2f}x (per minibatch {min(each):.2f}-{max(each):.2f}x)"
    if min(each) <= 1.0 <= max(each):
        return speedup, (
            f"{r['comm']} + {r['policy']}: the per-minibatch speedups straddle 1.00x, so "
            f"{ratio:.2f}x is within this machine's noise"
        )
    return speedup, None


def _print_legend(base) -> None:
    measured = len(base.get("minibatch_seconds") or []) or base.get("steps_measured", 0)
    print(
        f"""
legend: step s      wall time of one minibatch on the slowest rank, over the {measured} measured
                    minibatches (after 1 warm-up, not counted)
        pred s, err the planner's predicted seconds per minibatch; err = predicted / measured - 1
        bubble      measured share of the ranks' time spent idle, 1 - sum(busy) / (ranks x
                    sum(span)) over the measured minibatches, busy = time inside forward+backward;
                    n/a under the FSDP2 arms: waits inside FSDP2's collectives count as busy
                    there, so idle time is not measured (compare step times instead)
        predicted   the planner's bubble for the same minibatches, from its cost model above,
                    weighted by time like the measured one (ranks meeting per microbatch under
                    collective and fsdp2-deferred, at the minibatch's edges otherwise)
        peak GiB    peak GPU memory per rank incl. odc's buffers; n/a = not measured (CPU)
        speedup     samples/s against the first row; in brackets the range over the minibatches
                    (same samples in both runs); a range that straddles 1.00x means no
                    measurable difference"""
    )
    if base["device"] == "cpu":
        print(
            """        CPU runs: the ranks are processes sharing this machine's few cores, so they slow
        each other down; busy time includes that contention, and measured bubbles and speedups
        are not what GPUs (one device per rank) show. They check the mechanics and that both
        modes train alike; GPU numbers: docs/benchmarks.md."""
        )


def _print_per_minibatch(results) -> None:
    """Each run's predicted / measured span per minibatch, one column per run."""
    from .table import format_table, signed_percent

    print("\nper minibatch, predicted / measured span in seconds (error):")
    header = ["mb"] + [f"{r['comm']} {_run_label(r)}" for r in results]
    rows = []
    for index in range(max(len(r["per_minibatch"]) for r in results)):
        cells = [str(index + 1)]
        for r in results:
            if index >= len(r["per_minibatch"]):
                cells.append("")
                continue
            row = r["per_minibatch"][index]
            cells.append(
                f"{row['predicted_span_seconds']:.3f} / {row['measured_span_seconds']:.3f} "
                f"({signed_percent(row['relative_error'])})"
            )
        rows.append(cells)
    print("\n".join(format_table(header, rows, "r" * len(header), indent="  ")))


def print_mesh_table(results) -> None:
    """Hybrid (HSDP) runs: the mesh of every run and the cross-replica reduction of ODC hybrid."""
    if all(r.get("mesh", [1])[0] == 1 for r in results):
        return
    print(
        f"\n{'comm':15} {'policy':14} {'mesh RxS':>8} {'cross-replica s':>15} "
        f"{'MiB/rank':>9} {'peak GiB':>9}"
    )
    for r in results:
        replicas, shards = r["mesh"]
        seconds = r.get("replica_reduce_seconds")
        reduce = f"{seconds:15.4f}" if seconds is not None else f"{'in backward':>15}"
        if replicas == 1:
            reduce = f"{'-':>15}"
        print(
            f"{r['comm']:15} {r['policy']:14} {f'{replicas}x{shards}':>8} {reduce} "
            f"{r.get('replica_reduce_bytes', 0) / 2**20:9.1f} {r['peak_memory_bytes'] / 2**30:9.2f}"
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
            f"{result['comm']} + {_run_label(result).replace('+', ' + ')}: "
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
