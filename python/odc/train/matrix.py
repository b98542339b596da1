"""The runs one `python -m odc.train` command makes: --comm/--policy, --compare or --all, each with
--split, --kv-exchange and --mesh. A pure function of those options (no printing, launching or
files), so the matrix is tested without training. Invariant: a run exchanges K/V through odc only
if it is an ODC run that splits; every other run says "nccl" (or splits nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import InvalidArgument

# The comm x policy pairs of --all, in its order. Collective FSDP2 cannot run lb-mini: it gives
# ranks different microbatch counts, and every rank must enter each collective.
COMBINATIONS = {
    "collective": ("local-sort", "lb-micro"),
    "odc": ("local-sort", "lb-micro", "lb-mini"),
}


class UsageError(InvalidArgument):
    """A mistake in the command line or its inputs: one line on stderr, exit status 2. It lives
    here, below `__main__`, so that the matrix can refuse a combination without importing the CLI."""


def usage_error(message: str):
    raise UsageError(message)


@dataclass(frozen=True)
class RunSpec:
    """One run of the command: what `RunConfig` takes from the matrix."""

    comm: str  # "collective" | "odc"
    policy: str  # "local-sort" | "lb-micro" | "lb-mini"
    split: str  # "off" | "auto"
    kv_exchange: str  # "nccl" | "odc": how a split group exchanges K/V
    mesh: Optional[Tuple[int, int]]  # (replicas, shards) of an HSDP mesh; None: flat (1-D)

    @property
    def label(self) -> str:
        """'odc + lb-mini + split (K/V through odc)': how the progress lines name the run."""
        label = f"{self.comm} + {self.policy}" + (" + split" if self.split == "auto" else "")
        if self.split == "auto" and self.comm == "odc":
            label += f" (K/V through {self.kv_exchange})"
        return label


def run_matrix(
    *,
    comm: str = "odc",
    policy: str = "lb-mini",
    compare: bool = False,
    all_runs: bool = False,
    split: str = "off",
    kv_exchange: str = "auto",
    mesh: Optional[Tuple[int, int]] = None,
    transport: Optional[str] = None,
) -> list:
    """The runs, in the order they run, for the command-line options of the same names (defaults
    as on the command line; `all_runs` is --all). `mesh` is the parsed --mesh with more than one
    replica, or None (flat: no --mesh, or one replica). `transport` is $ODC_TRANSPORT (None:
    unset): NVSHMEM cannot split a communicator, so its runs exchange K/V through NCCL. Raises
    UsageError for a combination that cannot run, with the command line's message."""
    _check(comm, policy, compare or all_runs, split, kv_exchange, mesh)
    if kv_exchange in ("odc", "both") and transport == "nvshmem":
        usage_error(
            f"--kv-exchange {kv_exchange} needs odc sub-communicators, which the NVSHMEM "
            "transport cannot make: use --kv-exchange nccl (or auto)"
        )
    if all_runs:
        pairs = [(c, p) for c, policies in COMBINATIONS.items() for p in policies]
    elif compare:
        pairs = [("collective", "lb-micro"), ("odc", "lb-mini")]
    else:
        pairs = [(comm, policy)]
    # (comm, policy, split, mesh): with --split auto, lb-micro and lb-mini split (issue #14), and
    # --compare adds the strongest collective baseline, collective + lb-micro + split (this
    # replaces the pairs even with --all).
    runs = [(c, p, split if p != "local-sort" else "off", mesh) for c, p in pairs]
    if compare and split == "auto":
        runs = [
            ("collective", "lb-micro", "off", mesh),
            ("collective", "lb-micro", "auto", mesh),
            ("odc", "lb-mini", "auto", mesh),
        ]
    if mesh is not None and compare:  # hybrid against flat ODC on the same ranks
        runs.append(("odc", "lb-mini", split, None))
    return [
        RunSpec(c, p, s, exchange, m)
        for c, p, s, m in runs
        for exchange in _exchanges(c, s, kv_exchange, m, transport)
    ]


def _exchanges(comm: str, split: str, kv_exchange: str, mesh, transport=None) -> tuple:
    """The K/V exchanges one (comm, policy, split) runs with: ODC runs that split take
    --kv-exchange (both: one run with each, nccl first); every other run says nccl."""
    if comm != "odc" or split != "auto":
        return ("nccl",)
    if kv_exchange == "both":
        return ("nccl", "odc")
    if kv_exchange == "auto":
        # docs/benchmarks.md: heavy-tailed, 4 H200s, odc ahead of nccl in both rounds that
        # measured the two (1.41x vs 1.38x, 1.391x vs 1.351x).
        # odc needs a flat mesh (the plan's ranks are the communicator's) and sub-communicators.
        return ("odc" if mesh is None and transport != "nvshmem" else "nccl",)
    return (kv_exchange,)


def _check(comm, policy, several: bool, split, kv_exchange, mesh) -> None:
    """Refuses what cannot run. --compare and --all (`several`) choose comm and policy
    themselves, so --comm/--policy are not checked against them."""
    if comm == "collective" and policy == "lb-mini" and not several:
        usage_error(
            "lb-mini gives ranks different microbatch counts, which collective FSDP2 "
            "cannot run: use --comm odc, or --policy lb-micro / local-sort"
        )
    if split == "auto" and policy == "local-sort" and not several:
        usage_error("--split auto needs --policy lb-mini or lb-micro")
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
