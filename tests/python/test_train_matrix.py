"""The run matrix of `python -m odc.train` (odc.train.matrix.run_matrix): which runs each command
line makes, in which order, with which labels, and the combinations it refuses. Pure: nothing is
launched, so every case takes microseconds; no torch needed."""

import dataclasses

import pytest

import odc
from odc.train.__main__ import main
from odc.train.matrix import RunSpec, UsageError, run_matrix

MESH = (2, 2)


def runs(**options):
    """The matrix as (comm, policy, split, kv_exchange, mesh) tuples, for compact expectations."""
    return [(r.comm, r.policy, r.split, r.kv_exchange, r.mesh) for r in run_matrix(**options)]


def labels(**options):
    return [r.label for r in run_matrix(**options)]


def test_default_is_one_odc_lb_mini_run():
    assert run_matrix() == [RunSpec("odc", "lb-mini", "off", "nccl", None)]
    assert labels() == ["odc + lb-mini"]


def test_one_run_takes_comm_and_policy():
    assert runs(comm="collective", policy="local-sort") == [
        ("collective", "local-sort", "off", "nccl", None)
    ]


def test_compare_runs_the_collective_baseline_first():
    assert runs(compare=True) == [
        ("collective", "lb-micro", "off", "nccl", None),
        ("odc", "lb-mini", "off", "nccl", None),
    ]
    # --compare chooses comm and policy itself: what --comm/--policy say does not matter.
    assert runs(compare=True, comm="collective", policy="local-sort") == runs(compare=True)


def test_all_runs_the_eight_combinations_in_order():
    assert runs(all_runs=True) == [
        ("collective", "local-sort", "off", "nccl", None),
        ("collective", "lb-micro", "off", "nccl", None),
        ("collective", "lb-mini-padded", "off", "nccl", None),
        ("fsdp2-deferred", "lb-micro", "off", "nccl", None),
        ("fsdp2-unsharded", "lb-mini", "off", "nccl", None),
        ("odc", "local-sort", "off", "nccl", None),
        ("odc", "lb-micro", "off", "nccl", None),
        ("odc", "lb-mini", "off", "nccl", None),
    ]
    assert labels(all_runs=True)[1] == "collective + lb-micro"


def test_all_with_split_splits_lb_micro_and_lb_mini_under_collective_and_odc():
    # local-sort keeps its fixed assignment; lb-mini-padded and the deferred-sync FSDP2 arms run
    # without split samples.
    assert runs(all_runs=True, split="auto") == [
        ("collective", "local-sort", "off", "nccl", None),
        ("collective", "lb-micro", "auto", "nccl", None),
        ("collective", "lb-mini-padded", "off", "nccl", None),
        ("fsdp2-deferred", "lb-micro", "off", "nccl", None),
        ("fsdp2-unsharded", "lb-mini", "off", "nccl", None),
        ("odc", "local-sort", "off", "nccl", None),
        ("odc", "lb-micro", "auto", "odc", None),
        ("odc", "lb-mini", "auto", "odc", None),
    ]


def test_baselines_run_odc_against_the_four_fsdp2_baselines():
    assert runs(baselines=True) == [
        ("collective", "lb-micro", "off", "nccl", None),
        ("fsdp2-deferred", "lb-micro", "off", "nccl", None),
        ("fsdp2-unsharded", "lb-mini", "off", "nccl", None),
        ("collective", "lb-mini-padded", "off", "nccl", None),
        ("odc", "lb-mini", "off", "nccl", None),
    ]
    assert labels(baselines=True)[2] == "fsdp2-unsharded + lb-mini"
    # Like --compare, --baselines chooses comm and policy itself.
    assert runs(baselines=True, comm="collective") == runs(baselines=True)
    assert all(r.mesh == MESH for r in run_matrix(baselines=True, mesh=MESH))


@pytest.mark.parametrize(
    "comm, policy",
    [
        ("fsdp2-deferred", "lb-micro"),
        ("fsdp2-deferred", "lb-mini-padded"),
        ("fsdp2-unsharded", "lb-mini"),
        ("fsdp2-unsharded", "lb-micro"),  # equal counts are legal too
        ("collective", "lb-mini-padded"),
        ("odc", "lb-mini-padded"),
    ],
)
def test_each_arm_is_selectable(comm, policy):
    assert runs(comm=comm, policy=policy) == [(comm, policy, "off", "nccl", None)]


@pytest.mark.parametrize(
    "kv_exchange, exchanges",
    [("auto", ["odc"]), ("odc", ["odc"]), ("nccl", ["nccl"]), ("both", ["nccl", "odc"])],
)
def test_split_odc_run_takes_the_kv_exchange(kv_exchange, exchanges):
    assert runs(split="auto", kv_exchange=kv_exchange) == [
        ("odc", "lb-mini", "auto", exchange, None) for exchange in exchanges
    ]
    assert labels(split="auto", kv_exchange=kv_exchange) == [
        f"odc + lb-mini + split (K/V through {exchange})" for exchange in exchanges
    ]


@pytest.mark.parametrize(
    "kv_exchange, exchanges",
    [("auto", ["odc"]), ("odc", ["odc"]), ("nccl", ["nccl"]), ("both", ["nccl", "odc"])],
)
def test_compare_with_split_adds_the_split_collective_baseline(kv_exchange, exchanges):
    # Collective runs always exchange through NCCL; only the ODC run follows --kv-exchange.
    assert runs(compare=True, split="auto", kv_exchange=kv_exchange) == [
        ("collective", "lb-micro", "off", "nccl", None),
        ("collective", "lb-micro", "auto", "nccl", None),
        *[("odc", "lb-mini", "auto", exchange, None) for exchange in exchanges],
    ]
    assert labels(compare=True, split="auto", kv_exchange=kv_exchange)[:2] == [
        "collective + lb-micro",
        "collective + lb-micro + split",
    ]


def test_compare_with_split_replaces_the_pairs_of_all():
    # --compare --split auto decides the runs even beside --all (as the CLI always has).
    assert runs(compare=True, all_runs=True, split="auto") == runs(compare=True, split="auto")


def test_split_collective_lb_micro_exchanges_through_nccl():
    assert labels(comm="collective", policy="lb-micro", split="auto") == [
        "collective + lb-micro + split"
    ]
    assert runs(comm="collective", policy="lb-micro", split="auto")[0][3] == "nccl"


def test_mesh_run_keeps_its_mesh():
    assert runs(mesh=MESH) == [("odc", "lb-mini", "off", "nccl", MESH)]


def test_compare_on_a_mesh_adds_flat_odc():
    assert runs(compare=True, mesh=MESH) == [
        ("collective", "lb-micro", "off", "nccl", MESH),
        ("odc", "lb-mini", "off", "nccl", MESH),
        ("odc", "lb-mini", "off", "nccl", None),
    ]


def test_auto_exchange_is_nccl_on_a_mesh_and_odc_on_the_flat_run():
    assert runs(compare=True, split="auto", mesh=MESH) == [
        ("collective", "lb-micro", "off", "nccl", MESH),
        ("collective", "lb-micro", "auto", "nccl", MESH),
        ("odc", "lb-mini", "auto", "nccl", MESH),
        ("odc", "lb-mini", "auto", "odc", None),
    ]


def test_all_on_a_mesh_adds_no_flat_run():
    assert all(r.mesh == MESH for r in run_matrix(all_runs=True, mesh=MESH))


def test_run_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        run_matrix()[0].comm = "collective"


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(comm="collective"),
            "lb-mini gives ranks different microbatch counts, which collective FSDP2 cannot "
            "run (it all-gathers per layer in every microbatch): use --comm odc or "
            "fsdp2-unsharded, or --policy lb-mini-padded / lb-micro / local-sort",
        ),
        (
            dict(comm="fsdp2-deferred"),
            "lb-mini gives ranks different microbatch counts, which " "fsdp2-deferred cannot run",
        ),
        (
            dict(comm="fsdp2-unsharded", split="auto"),
            "--split auto is not supported with --comm fsdp2-unsharded",
        ),
        (
            dict(comm="collective", policy="lb-mini-padded", split="auto"),
            "--split auto needs --policy lb-mini or lb-micro",
        ),
        (dict(baselines=True, compare=True), "--baselines runs its own five arms"),
        (dict(baselines=True, all_runs=True), "--baselines runs its own five arms"),
        (dict(baselines=True, split="auto"), "--baselines runs without split samples"),
        (
            dict(policy="local-sort", split="auto"),
            "--split auto needs --policy lb-mini or lb-micro",
        ),
        (dict(kv_exchange="odc"), "--kv-exchange odc needs --split auto"),
        (dict(kv_exchange="both"), "--kv-exchange both needs --split auto"),
        (
            dict(comm="collective", policy="lb-micro", split="auto", kv_exchange="both"),
            "--kv-exchange both is for ODC runs (collective runs exchange K/V through NCCL): "
            "use --comm odc",
        ),
        (
            dict(split="auto", kv_exchange="odc", mesh=MESH),
            "--kv-exchange odc runs on a flat mesh only (no --mesh)",
        ),
        (
            dict(compare=True, split="auto", kv_exchange="both", mesh=MESH),
            "--kv-exchange odc runs on a flat mesh only (no --mesh)",
        ),
        # The first mistake found is the one named: comm and policy before split and exchange.
        (
            dict(comm="collective", split="auto", kv_exchange="odc", mesh=MESH),
            "lb-mini gives ranks different microbatch counts",
        ),
    ],
)
def test_refused_combinations(options, message):
    with pytest.raises(UsageError) as raised:
        run_matrix(**options)
    assert str(raised.value).startswith(message)
    assert isinstance(raised.value, odc.InvalidArgument) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "options",
    [
        dict(compare=True, comm="collective"),  # --compare/--all choose comm and policy
        dict(all_runs=True, policy="local-sort", split="auto"),
        dict(all_runs=True, comm="collective", split="auto", kv_exchange="odc"),
        dict(split="auto", kv_exchange="nccl", mesh=MESH),  # nccl is allowed on a mesh
        dict(kv_exchange="nccl"),  # and needs no split
    ],
)
def test_accepted_combinations(options):
    assert run_matrix(**options)


def test_cli_refuses_through_the_matrix_with_one_line(capsys):
    # Checked before torch is imported or any rank starts, so this needs neither.
    status = main(["--lengths", "x.txt", "--split", "auto", "--policy", "local-sort"])
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        "python -m odc.train: error: --split auto needs --policy lb-mini or lb-micro"
    ]


def test_nvshmem_runs_exchange_kv_through_nccl():
    """NVSHMEM cannot split a communicator: auto picks nccl there, and odc or both is refused
    naming the flag that works."""
    (run,) = run_matrix(split="auto", transport="nvshmem")
    assert run.kv_exchange == "nccl"
    (run,) = run_matrix(split="auto", transport="cuda")
    assert run.kv_exchange == "odc"
    for exchange in ("odc", "both"):
        with pytest.raises(UsageError, match="--kv-exchange nccl"):
            run_matrix(split="auto", kv_exchange=exchange, transport="nvshmem")


def test_steal_both_runs_every_odc_run_without_then_with_stealing():
    specs = run_matrix(compare=True, steal="both")
    assert [(s.comm, s.steal) for s in specs] == [
        ("collective", False),
        ("odc", False),
        ("odc", True),
    ]
    assert [s.label for s in specs][-1] == "odc + lb-mini + steal"
    assert [s.steal for s in run_matrix(baselines=True, steal="on")] == [False] * 4 + [True]


def test_steal_without_an_odc_run_is_refused():
    with pytest.raises(UsageError, match="none of the runs is an ODC run"):
        run_matrix(comm="collective", policy="lb-micro", steal="on")
    with pytest.raises(UsageError, match="--steal must be off, on or both"):
        run_matrix(steal="yes")
    with pytest.raises(UsageError, match="flat mesh only"):
        run_matrix(steal="on", mesh=MESH)


def test_rank_slowdown_parses_and_names_the_mistake():
    from odc.train.__main__ import parse_rank_slowdown

    assert parse_rank_slowdown(None, 4) == {}
    assert parse_rank_slowdown(["1:1.3", "3:2"], 4) == {1: 1.3, 3: 2.0}
    for texts, message in (
        (["4:1.3"], "rank 4 is not one of the 4 ranks"),
        (["1:0.5"], "FACTOR must be >= 1"),
        (["1"], "must be RANK:FACTOR"),
        (["1:x"], "must be RANK:FACTOR"),
        (["1:1.2", "1:1.3"], "names rank 1 twice"),
    ):
        with pytest.raises(UsageError, match=message):
            parse_rank_slowdown(texts, 4)
