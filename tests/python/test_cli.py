"""The command-line surface a new user meets: `odc --version`, `odc compare --format/--plot`, and
`python -m odc.train`'s usage errors (exit 2, one line), CPU guards and run directories."""

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMON = ["--ranks", "4", "--max-tokens", "32768", "--minibatch-size", "64"]


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)


def test_version(odc_cli):
    import odc

    result = run([odc_cli, "--version"])
    assert result.returncode == 0
    assert result.stdout.strip() == f"odc {odc.__version__}"


def test_compare_formats_agree(odc_cli, data_dir):
    lengths = ["--lengths", str(data_dir / "aime_rl_like.txt")]
    table = run([odc_cli, "compare", *lengths, *COMMON])
    as_json = run([odc_cli, "compare", *lengths, *COMMON, "--format", "json"])
    as_csv = run([odc_cli, "compare", *lengths, *COMMON, "--format", "csv"])
    for result in (table, as_json, as_csv):
        assert result.returncode == 0, result.stderr
    comparison = json.loads(as_json.stdout)
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [p["policy"] for p in comparison["policies"]] == ["local-sort", "lb-micro", "lb-mini"]
    assert [r["policy"] for r in rows] == ["local-sort", "lb-micro", "lb-mini"]
    by_policy = {p["policy"]: p for p in comparison["policies"]}
    # The baseline is collective + lb-micro; lb-mini has no collective figures.
    assert by_policy["lb-micro"]["speedup"]["collective"] == pytest.approx(1.0)
    assert by_policy["lb-mini"]["bubble"]["collective"] is None
    assert rows[2]["bubble_collective"] == "" and rows[2]["speedup_collective"] == ""
    for policy, row in zip(comparison["policies"], rows):
        assert float(row["bubble_odc"]) == pytest.approx(policy["bubble"]["odc"], abs=1e-6)
        assert f"{100 * policy['bubble']['odc']:.1f}%" in table.stdout
    # The speedup of odc + lb-mini follows from the bubbles when both run the same work.
    speedup = by_policy["lb-mini"]["speedup"]["odc"]
    assert speedup > 1.0
    assert f"{speedup:.2f}x" in table.stdout.splitlines()[-1]
    # The same numbers as the planner's own plan.
    import odc

    plan = odc.plan(
        odc.read_lengths(str(data_dir / "aime_rl_like.txt")),
        ranks=4,
        max_tokens=32768,
        policy="lb-mini",
        samples_per_rank=16,
    )
    assert by_policy["lb-mini"]["bubble"]["odc"] == pytest.approx(plan["bubble"]["odc"])


def test_compare_rejects_an_unknown_format(odc_cli, data_dir):
    result = run([odc_cli, "compare", "--lengths", str(data_dir / "aime_rl_like.txt"), *COMMON,
                  "--format", "xml"])  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr == "odc compare: error: unknown format 'xml': expected table, json or csv\n"
    )


def test_compare_plot_writes_a_png(odc_cli, data_dir, tmp_path):
    pytest.importorskip("matplotlib")
    figure = tmp_path / "planner.png"
    env = dict(os.environ, ODC_PYTHON=sys.executable)
    result = run([odc_cli, "compare", "--lengths", str(data_dir / "aime_rl_like.txt"), *COMMON,
                  "--plot", str(figure)], env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"plot: {figure}" in result.stdout
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unsupported_plot_format_is_a_usage_error(odc_cli, data_dir, tmp_path):
    # matplotlib refuses .txt only after drawing (status 1, its ValueError): checked up front,
    # one line, status 2 as every usage error, before any planning or simulation.
    bad = tmp_path / "out.txt"
    lengths = ["--lengths", str(data_dir / "aime_rl_like.txt")]
    for command in (
        [odc_cli, "compare", *lengths, *COMMON, "--plot", str(bad)],
        [odc_cli, "simulate", *lengths, "--ranks", "8", "--minibatches", "1", "--plot", str(bad)],
    ):
        result = run(command)
        assert result.returncode == 2, (command, result.stderr)
        (line,) = result.stderr.splitlines()
        assert f"cannot write the plot to '{bad}': unsupported format 'txt'" in line, line
        assert not bad.exists()
    # The drawers run directly say so in one line with status 2 too.
    pytest.importorskip("matplotlib")
    for module, document in (("odc.simulate", '{"results": []}'), ("odc.compare_plot", "{}")):
        command = [sys.executable, "-m", module, *(["--draw"] if module == "odc.simulate" else [])]
        if module == "odc.compare_plot":
            document = json.dumps(json.loads(run([odc_cli, "compare", *lengths, *COMMON,
                                                  "--format", "json"]).stdout))  # fmt: skip
        result = subprocess.run([*command, str(bad)], input=document, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert result.returncode == 2, (module, result.stderr)
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"{module}: error: cannot write {bad}: "), line


def test_compare_plot_failure_is_an_error(odc_cli, data_dir, tmp_path):
    env = dict(os.environ, ODC_PYTHON=str(tmp_path / "no-such-python"))
    result = run([odc_cli, "compare", "--lengths", str(data_dir / "aime_rl_like.txt"), *COMMON,
                  "--plot", str(tmp_path / "p.png")], env=env)  # fmt: skip
    assert result.returncode == 1
    assert "cannot start" in result.stderr and "ODC_PYTHON" in result.stderr


def train(*args, cwd):
    return run([sys.executable, "-m", "odc.train", *args], cwd=cwd)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cpu"], "one of the arguments --lengths --jsonl --rollouts is required"),
        (["--lengths", "x.txt", "--bogus"], "unrecognized arguments: --bogus"),
        (["--lengths", "x.txt", "--ranks", "1"], "needs at least 2 ranks, got 1"),
        (["--lengths", "x.txt", "--steps", "0"], "--steps must be at least 1, got 0"),
    ],
)
def test_train_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    result = train(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m odc.train: error: ")
    assert message in lines[0]


def test_train_names_a_token_id_beyond_the_vocabulary(tmp_path):
    # A traceback from inside the ranks before; now checked before any rank starts.
    pytest.importorskip("torch")
    data = tmp_path / "tokens.jsonl"
    data.write_text("[1, 2, 3]\n[4, 5000]\n")
    result = train("--jsonl", str(data), "--device", "cpu", "--preset", "tiny", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"python -m odc.train: error: '{data}' line 2: token id 5000 is beyond the vocabulary "
        "of 1024"
    ]


def test_train_refuses_gpu_sized_work_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    lengths = str(REPO / "data" / "longalign_like.txt")
    big = train("--lengths", lengths, "--device", "cpu", "--ranks", "2", cwd=tmp_path)
    assert big.returncode == 2
    assert "GPU-sized" in big.stderr and "--length-scale 0.0625" in big.stderr
    preset = train("--lengths", lengths, "--device", "cpu", "--preset", "1.5b",
                   "--length-scale", "0.01", cwd=tmp_path)  # fmt: skip
    assert preset.returncode == 2
    assert "the 1.5b preset is GPU-sized" in preset.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_train_never_overwrites_results(tmp_path):
    pytest.importorskip("torch")
    existing = tmp_path / "results.json"
    existing.write_text("keep me")
    result = train("--lengths", str(REPO / "data" / "aime_rl_like.txt"), "--device", "cpu",
                   "--length-scale", "0.004", "--output", str(existing), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    assert f"{existing} exists" in result.stderr
    assert existing.read_text() == "keep me"


def test_import_odc_torch_without_torch_names_the_extra(tmp_path):
    # A site directory whose `torch` cannot be imported stands in for an install without torch.
    blocker = tmp_path / "torch.py"
    blocker.write_text("raise ImportError('No module named torch')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = run([sys.executable, "-c", "import odc; import odc.torch"], env=env)
    assert result.returncode == 1
    assert "odc.torch needs PyTorch (2.9 or newer): pip install 'odc[torch]'" in result.stderr


def test_cost_floor_on_the_command_line(odc_cli, data_dir):
    """`--cost A,B,C,F`: `odc plan` reports the floor and predicts with it, `odc compare` and
    `odc simulate` take it too, and a negative floor is named."""
    lengths = str(data_dir / "aime_rl_like.txt")
    documents = []
    for cost in ("3e-05,1.2e-09,0.07", "3e-05,1.2e-09,0.07,3"):  # 3 s: every microbatch
        result = run(
            [odc_cli, "plan", "--lengths", lengths, *COMMON, "--policy", "lb-mini", "--cost", cost]
        )
        assert result.returncode == 0, result.stderr
        documents.append(json.loads(result.stdout))
    assert "floor" not in documents[0]["cost"] and documents[1]["cost"]["floor"] == 3
    assert documents[1]["bubble"] != documents[0]["bubble"]  # the floor changed the prediction
    compare = run(
        [odc_cli, "compare", "--lengths", lengths, *COMMON, "--cost", "3e-05,1.2e-09,0.07,0.3",
         "--format", "json"]
    )  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    assert json.loads(compare.stdout)["cost"]["floor"] == 0.3
    simulated = run(
        [odc_cli, "simulate", "--lengths", lengths, "--ranks", "4", "--model", "1.5b",
         "--cost", "3e-05,1.2e-09,0.07,0.3", "--format", "json"]
    )  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
    assert json.loads(simulated.stdout)["cost"]["floor"] == 0.3
    bad = run(
        [
            odc_cli,
            "plan",
            "--lengths",
            lengths,
            *COMMON,
            "--policy",
            "lb-mini",
            "--cost",
            "1,0,0,-1",
        ]
    )
    assert bad.returncode == 2 and "malformed cost floor -1" in bad.stderr


def test_train_never_overwrites_profiles(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "odc_lb-mini_rank0.json.gz").write_bytes(b"")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("10\n12\n")
    result = run(
        [sys.executable, "-m", "odc.train", "--device", "cpu", "--lengths", str(lengths),
         "--profile", str(profiles)],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{profiles} already holds profiles" in result.stderr


def test_odc_alone_lists_its_subcommands(odc_cli):
    result = run([odc_cli])
    assert result.returncode == 2
    for subcommand in ("plan", "compare", "simulate"):
        assert f"\n  {subcommand} " in result.stderr, result.stderr


SHARED_OPTIONS = ["--lengths", "--ranks", "--samples-per-rank", "--max-tokens", "--max-length"]
SHARED_OPTIONS += ["--cost", "--microbatch-memory", "--format"]
SHARED_OPTIONS += ["--rank-speed", "--split", "--split-exchange"]


def test_one_vocabulary_for_plan_compare_and_simulate(odc_cli, data_dir, tmp_path):
    # The three subcommands spell the sample options alike, with the same defaults
    # (odc.train's: 4 samples per rank, the cap = the longest sample kept).
    for subcommand in ("plan", "compare", "simulate"):
        usage = run([odc_cli, subcommand, "--help"]).stdout
        for option in SHARED_OPTIONS:
            assert option in usage, (subcommand, option)
        assert "--samples-per-rank INT=4" in usage, subcommand
    path = tmp_path / "lengths.txt"
    lengths = [30000, 100, 200, 25000, 300, 400, 500, 600, 700, 800, 900, 1000, 1100]
    path.write_text("\n".join(map(str, lengths)) + "\n")
    selection = ["--lengths", str(path), "--ranks", "2", "--max-length", "20000"]
    plan = run([odc_cli, "plan", *selection, "--policy", "lb-micro", "--samples-per-rank", "2"])
    assert plan.returncode == 0, plan.stderr
    document = json.loads(plan.stdout)
    # Samples above --max-length are dropped; the plan names the others by their line in the
    # file; the cap defaults to the longest sample kept.
    assert document["max_tokens"] == 1100
    assert [m["samples"] for m in document["minibatches"]] == [
        [1, 2, 4, 5],
        [6, 7, 8, 9],
        [10, 11, 12],
    ]
    # The defaults: 4 samples per rank; --minibatch-size stays as the deprecated spelling.
    default = json.loads(run([odc_cli, "plan", *selection, "--policy", "lb-micro"]).stdout)
    assert [len(m["samples"]) for m in default["minibatches"]] == [8, 3]
    old = run([odc_cli, "plan", *selection, "--policy", "lb-micro", "--minibatch-size", "4"])
    assert old.returncode == 0 and json.loads(old.stdout) == document
    compare = run([odc_cli, "compare", *selection, "--samples-per-rank", "2", "--format", "json"])
    assert compare.returncode == 0, compare.stderr
    assert json.loads(compare.stdout)["minibatch_size"] == 4
    simulate = run([odc_cli, "simulate", *selection, "--samples-per-rank", "2", "--minibatches",
                    "2", "--format", "json"])  # fmt: skip
    assert simulate.returncode == 0, simulate.stderr
    assert json.loads(simulate.stdout)["max_tokens"] == 1100


def test_compare_task_grpo_counts_both_forward_only_passes_and_the_updates(odc_cli, tmp_path):
    """`odc compare --task grpo`: per RL step its forward-only minibatch twice (forward cost) and
    its K update minibatches, the bubble time-weighted over all of it; recomputed here from
    odc.plan's plans of the same steps (linear cost: a microbatch costs a x its tokens)."""
    import odc

    lengths = [5, 9, 2, 7, 3, 8, 1, 6, 4, 4, 10, 2, 6, 3, 5, 7]
    path = tmp_path / "rollouts.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    common = ["--lengths", str(path), "--ranks", "2", "--samples-per-rank", "4",
              "--max-tokens", "16", "--cost", "1,0,0"]  # fmt: skip
    result = subprocess.run([odc_cli, "compare", *common, "--task", "grpo", "--format", "json"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert (
        "GRPO: per RL step 2 forward-only minibatches at 0.25,0,0 and 2 updates"
        in (document["decision"]["reason"])
    )

    def times(plan, a):  # per minibatch: (busy, collective span, odc span)
        out = []
        for minibatch in plan["minibatches"]:
            costs = [[a * sum(lengths[i] for i in mb) for mb in rank["microbatches"]]
                     for rank in minibatch["ranks"]]  # fmt: skip
            steps = max(len(c) for c in costs)
            collective = sum(max(c[k] if k < len(c) else 0.0 for c in costs) for k in range(steps))
            out.append((sum(map(sum, costs)), collective, max(map(sum, costs))))
        return out

    for row in document["policies"]:
        policy = row["policy"]
        plan = dict(ranks=2, max_tokens=16, policy=policy)
        forward = times(odc.plan(lengths, samples_per_rank=4, cost=(0.25, 0, 0), **plan), 0.25)
        update = times(odc.plan(lengths, samples_per_rank=2, cost=(1, 0, 0), **plan), 1.0)
        parts = [p for s in range(2) for p in (forward[s], forward[s], *update[2 * s : 2 * s + 2])]
        busy = sum(p[0] for p in parts)
        assert row["bubble"]["odc"] == pytest.approx(1 - busy / (2 * sum(p[2] for p in parts)))
        if policy != "lb-mini":
            expected = 1 - busy / (2 * sum(p[1] for p in parts))
            assert row["bubble"]["collective"] == pytest.approx(expected)
    # K must split an RL step's rollouts; an unknown task is named.
    for extra, message in ((["--task", "grpo", "--minibatches-per-step", "3"], "split evenly"),
                           (["--task", "rl"], "unknown --task 'rl'")):  # fmt: skip
        result = subprocess.run(
            [odc_cli, "compare", *common, *extra], capture_output=True, text=True
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
