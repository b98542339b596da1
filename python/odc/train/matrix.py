"""The runs one `python -m odc.train` command makes: --comm/--policy, --compare, --baselines or
--all, each with --split, --kv-exchange and --mesh. A pure function of those options (no printing, launching or
files), so the matrix is tested without training. Invariant: a run exchanges K/V through odc only
if it is an ODC run that splits; every other run says "nccl" (or splits nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import InvalidArgument

# The comm x policy pairs of --all, in its order (the arms: arms.py, docs/train.md "Arms").
# Collective FSDP2 and fsdp2-deferred cannot run lb-mini: it gives ranks different microbatch
# counts, and they all-gather per layer in every microbatch, which every rank must enter.
COMBINATIONS = {
    "collective": ("local-sort", "lb-micro", "lb-mini-padded"),
    "fsdp2-deferred": ("lb-micro",),
    "fsdp2-unsharded": ("lb-mini",),
    "odc": ("local-sort", "lb-micro", "lb-mini"),
}
# --baselines: ODC + LB-Mini against the strongest FSDP2 arms on the same plan inputs
# (docs/design.md "Baselines"), the plain FSDP2 baseline first (the table's reference row).
BASELINES = (
    ("collective", "lb-micro"),
    ("fsdp2-deferred", "lb-micro"),
    ("fsdp2-unsharded", "lb-mini"),
    ("collective", "lb-mini-padded"),
    ("odc", "lb-mini"),
)
# The FSDP2 arms that do not split samples (yet): their runs have split "off".
NO_SPLIT = ("fsdp2-deferred", "fsdp2-unsharded")


class UsageError(InvalidArgument):
    """A mistake in the command line or its inputs: one line on stderr, exit status 2. It lives
    here, below `__main__`, so that the matrix can refuse a combination without importing the CLI."""


def usage_error(message: str):
    raise UsageError(message)


@dataclass(frozen=True)
class RunSpec:
    """One run of the command: what `RunConfig` takes from the matrix."""

    comm: str  # "collective" | "fsdp2-deferred" | "fsdp2-unsharded" | "odc" (arms.COMMS)
    policy: str  # "local-sort" | "lb-micro" | "lb-mini" | "lb-mini-padded" (arms.POLICIES)
    split: str  # "off" | "auto"
    kv_exchange: str  # "nccl" | "odc": how a split group exchanges K/V
    mesh: Optional[Tuple[int, int]]  # (replicas, shards) of an HSDP mesh; None: flat (1-D)
    # ODC runs: ranks that run out of planned microbatches take other ranks' (work stealing,
    # OdcFSDP.microbatches); always False for the FSDP2 arms.
    steal: bool = False

    @property
    def label(self) -> str:
        """'odc + lb-mini + split (K/V through odc) + steal': how the progress lines name the run."""
        label = f"{self.comm} + {self.policy}" + (" + split" if self.split == "auto" else "")
        if self.split == "auto" and self.comm == "odc":
            label += f" (K/V through {self.kv_exchange})"
        return label + (" + steal" if self.steal else "")


def run_matrix(
    *,
    comm: str = "odc",
    policy: str = "lb-mini",
    compare: bool = False,
    all_runs: bool = False,
    baselines: bool = False,
    split: str = "off",
    kv_exchange: str = "auto",
    mesh: Optional[Tuple[int, int]] = None,
    transport: Optional[str] = None,
    steal: str = "off",
) -> list:
    """The runs, in the order they run, for the command-line options of the same names (defaults
    as on the command line; `all_runs` is --all). `mesh` is the parsed --mesh with more than one
    replica, or None (flat: no --mesh, or one replica). `transport` is $ODC_TRANSPORT (None:
    unset): NVSHMEM cannot split a communicator, so its runs exchange K/V through NCCL. Raises
    UsageError for a combination that cannot run, with the command line's message. `steal`:
    "off", "on" (every ODC run steals) or "both" (every ODC run twice: without, then with)."""
    _check(comm, policy, compare or all_runs or baselines, split, kv_exchange, mesh)
    if steal not in ("off", "on", "both"):
        usage_error(f"--steal must be off, on or both, got {steal!r}")
    if steal != "off" and mesh is not None:
        usage_error(
            f"--steal {steal} runs on a flat mesh only (on an HSDP mesh each replica's "
            "communicator would need its own share of the plan): drop --mesh or --steal"
        )
    if baselines and (compare or all_runs):
        usage_error("--baselines runs its own five arms: drop --compare/--all")
    if baselines and split == "auto":
        usage_error("--baselines runs without split samples (the FSDP2 arms cannot split yet)")
    if kv_exchange in ("odc", "both") and transport == "nvshmem":
        usage_error(
            f"--kv-exchange {kv_exchange} needs odc sub-communicators, which the NVSHMEM "
            "transport cannot make: use --kv-exchange nccl (or auto)"
        )
    if all_runs:
        pairs = [(c, p) for c, policies in COMBINATIONS.items() for p in policies]
    elif baselines:
        pairs = list(BASELINES)
    elif compare:
        pairs = [("collective", "lb-micro"), ("odc", "lb-mini")]
    else:
        pairs = [(comm, policy)]
    # (comm, policy, split, mesh): with --split auto, lb-micro and lb-mini split, and
    # --compare adds the strongest collective baseline, collective + lb-micro + split (this
    # replaces the pairs even with --all).
    runs = [(c, p, _split_of(c, p, split), mesh) for c, p in pairs]
    if compare and split == "auto":
        runs = [
            ("collective", "lb-micro", "off", mesh),
            ("collective", "lb-micro", "auto", mesh),
            ("odc", "lb-mini", "auto", mesh),
        ]
    if mesh is not None and compare:  # hybrid against flat ODC on the same ranks
        runs.append(("odc", "lb-mini", split, None))
    specs = [
        RunSpec(c, p, s, exchange, m, stealing)
        for c, p, s, m in runs
        for exchange in _exchanges(c, s, kv_exchange, m, transport)
        for stealing in _stealing(c, steal)
    ]
    if steal != "off" and not any(spec.steal for spec in specs):
        usage_error(
            f"--steal {steal}: none of the runs is an ODC run (only ODC lets a rank compute "
            "another rank's microbatch): add --comm odc, --compare or --baselines"
        )
    return specs


def _stealing(comm: str, steal: str) -> tuple:
    """The steal settings one run is made with: ODC runs take --steal (both: without, then
    with); FSDP2 arms cannot steal (every rank runs its own microbatches in lockstep)."""
    if comm != "odc" or steal == "off":
        return (False,)
    return (False, True) if steal == "both" else (True,)


def _split_of(comm: str, policy: str, split: str) -> str:
    """A run's split: --split, except for local-sort (a fixed assignment), lb-mini-padded and the
    arms of NO_SPLIT, which run without split samples."""
    if policy in ("local-sort", "lb-mini-padded") or comm in NO_SPLIT:
        return "off"
    return split


def _exchanges(comm: str, split: str, kv_exchange: str, mesh, transport=None) -> tuple:
    """The K/V exchanges one (comm, policy, split) runs with: ODC runs that split take
    --kv-exchange (both: one run with each, nccl first); every other run says nccl."""
    if comm != "odc" or split != "auto":
        return ("nccl",)
    if kv_exchange == "both":
        return ("nccl", "odc")
    if kv_exchange == "auto":
        # docs/benchmarks-archive.md: heavy-tailed, 4 H200s, odc ahead of nccl in both rounds that
        # measured the two (1.41x vs 1.38x, 1.391x vs 1.351x).
        # odc needs a flat mesh (the plan's ranks are the communicator's) and sub-communicators.
        return ("odc" if mesh is None and transport != "nvshmem" else "nccl",)
    return (kv_exchange,)


def _check(comm, policy, several: bool, split, kv_exchange, mesh) -> None:
    """Refuses what cannot run. --compare and --all (`several`) choose comm and policy
    themselves, so --comm/--policy are not checked against them."""
    if comm in ("collective", "fsdp2-deferred") and policy == "lb-mini" and not several:
        name = "collective FSDP2" if comm == "collective" else "fsdp2-deferred"
        usage_error(
            f"lb-mini gives ranks different microbatch counts, which {name} cannot run "
            "(it all-gathers per layer in every microbatch): use --comm odc or "
            "fsdp2-unsharded, or --policy lb-mini-padded / lb-micro / local-sort"
        )
    if split == "auto" and policy in ("local-sort", "lb-mini-padded") and not several:
        usage_error("--split auto needs --policy lb-mini or lb-micro")
    if split == "auto" and comm in NO_SPLIT and not several:
        usage_error(f"--split auto is not supported with --comm {comm}: use collective or odc")
    if kv_exchange in ("auto", "nccl"):
        return
    if split != "auto":
        usage_error(f"--kv-exchange {kv_exchange} needs --split auto")
    if comm == "collective" and not several:
        usage_error(
            f"--kv-exchange {kv_exchange} is for ODC runs (collective runs exchange "
            "K/V through NCCL): use --comm odc"
        )
    if mesh is not None:
        usage_error("--kv-exchange odc runs on a flat mesh only (no --mesh)")
