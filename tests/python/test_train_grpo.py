"""GRPO's training phase in odc.train on CPU processes, through the command line:
the forward-only phases, the actor update over K minibatches, ODC + LB-Mini against collective +
LB-Micro on the same rollouts, and the refusals (_check_runs says what is checked)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="odc.train needs torch")
pytest.importorskip("transformers", reason="the packed model needs transformers")


def _rollouts(path, groups=8, group_size=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(groups):
        prompt = int(rng.integers(4, 9))
        rows += [f"{group} {prompt} {int(rng.integers(8, 60))}" for _ in range(group_size)]
    path.write_text("# group prompt_tokens response_tokens\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.long
def test_cli_task_grpo_runs_every_arm(tmp_path):
    import json
    import subprocess
    import sys

    path = _rollouts(tmp_path / "rollouts.tsv")
    base = [sys.executable, "-m", "odc.train", "--preset", "tiny", "--device", "cpu",
            "--ranks", "3", "--cost", "1,0.01,0"]  # fmt: skip
    # (The refusals: test_cli_task_grpo_refuses_bad_input_before_torch.)
    # The five arms of --baselines on 3 ranks (LB-Mini leaves counts unequal there; the padded
    # and unsharded arms pad): the same losses, entropies and gradient norms in every arm.
    output = tmp_path / "results.json"
    command = base + ["--task", "grpo", "--rollouts", str(path), "--prompts-per-step", "4",
                      "--steps", "1", "--baselines", "--kl-coef", "0.05", "--output", str(output),
                      "--timeline", ""]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GRPO forward-only phases per RL step" in result.stdout
    assert "losses: AGREE across the 5 runs" in result.stdout
    runs = json.loads(output.read_text())
    assert [(r["comm"], r["policy"], r["task"]) for r in runs] == [
        ("collective", "lb-micro", "grpo"),
        ("fsdp2-deferred", "lb-micro", "grpo"),
        ("fsdp2-unsharded", "lb-mini", "grpo"),
        ("collective", "lb-mini-padded", "grpo"),
        ("odc", "lb-mini", "grpo"),
    ]
    _check_runs(runs, path)
    padded = runs[3]["microbatch_log"]
    assert any(m.get("lengths") == [] for mb in padded for rank in mb for m in rank)
    # fsdp2-unsharded: one all-gather per FSDP2 unit per update minibatch (the forward-only
    # phases gather outside the counted minibatches), one reduce-scatter per unit.
    units = runs[2]["fsdp2_collectives"][0][0]
    assert units["all_gather"] == units["reduce_scatter"] > 0


# Every bad value of an option --task grpo uses (the shared ones as it uses them), and bad
# rollouts: (extra arguments, the rollouts file's content or None, the one line expected after
# "python -m odc.train: error: "). Each ended in a traceback, trained to a nan loss with exit 0, or
# read a number Python's int() takes but nobody means ('1_0', '+5', Arabic-Indic digits).
_EIGHT_GROUPS = "".join(f"{g} 5 {9 + g}\n{g} 5 {10 + g}\n" for g in range(8))
_GRPO_REFUSALS = [
    # Non-finite, non-number and out-of-range floats.
    (["--kl-coef", "nan"], None, "argument --kl-coef: expected a finite number (e.g. 0.5 or 3e-4), got 'nan'"),
    (["--kl-coef", "inf"], None, "argument --kl-coef: expected a finite number (e.g. 0.5 or 3e-4), got 'inf'"),
    (["--kl-coef", "1e999"], None, "argument --kl-coef: '1e999' is beyond the range of a float"),
    (["--kl-coef", "-1"], None, "--kl-coef must be >= 0, got -1.0"),
    (["--kl-coef", ""], None, "argument --kl-coef: expected a finite number (e.g. 0.5 or 3e-4), got ''"),
    (["--lr", "nan"], None, "argument --lr: expected a finite number (e.g. 0.5 or 3e-4), got 'nan'"),
    (["--lr", "-1"], None, "--lr must be >= 0, got -1.0"),
    (["--length-scale", "inf"], None, "argument --length-scale: expected a finite number (e.g. 0.5 or 3e-4), got 'inf'"),
    (["--length-scale", "0"], None, "--length-scale must be positive, got 0.0"),
    (["--cost", "1e308,1e308,1e308"], None, "--cost 1e308,1e308,1e308 overflows: the samples' cost is infinite by sample 0 (14 tokens); scale the coefficients down"),
    (["--cost", "1,0,٠"], None, "--cost must be 'fit' or three non-negative numbers A,B,C (or four, A,B,C,F, with a floor F), got '1,0,٠'"),
    # Integers: plain ASCII digits only, then each option's range.
    (["--prompts-per-step", "٤"], None, "argument --prompts-per-step: expected a whole number (digits 0-9), got '٤'"),
    (["--prompts-per-step", "1_0"], None, "argument --prompts-per-step: expected a whole number (digits 0-9), got '1_0'"),
    (["--prompts-per-step", "+4"], None, "argument --prompts-per-step: expected a whole number (digits 0-9), got '+4'"),
    (["--prompts-per-step", "0"], None, "--prompts-per-step must be at least 1"),
    (["--prompts-per-step", "3"], None, "--prompts-per-step must be a multiple of --minibatches-per-step"),
    (["--minibatches-per-step", "-2"], None, "--minibatches-per-step must be at least 1"),
    (["--minibatches-per-step", "x"], None, "argument --minibatches-per-step: expected a whole number (digits 0-9), got 'x'"),
    (["--steps", " 1"], None, "argument --steps: expected a whole number (digits 0-9), got ' 1'"),
    (["--ranks", "99999999999"], None, "--ranks 99999999999: the planner plans at most 65536 ranks"),
    (["--max-tokens", "5"], None, "--max-tokens 5 is below the longest sample (22 tokens): every sample must fit in one microbatch"),
    (["--mesh", "2,٢"], None, "--mesh must be R,S (replicas, ranks per replica), got '2,٢'"),
    # Empty values mean nothing (they read as "not given" before): only --timeline '' is "none".
    (["--output", ""], None, "argument --output: expected a value, got '' (leave the option out for its default)"),
    (["--run-dir", ""], None, "argument --run-dir: expected a value, got '' (leave the option out for its default)"),
    (["--profile", ""], None, "argument --profile: expected a value, got '' (leave the option out for its default)"),
    # Options that do not go with --task grpo.
    (["--split", "auto"], None, "--task grpo does not split samples yet: drop --split"),
    # Compiled blocks with split samples: never run on a GPU (checked before the task's options).
    (["--compile", "--split", "auto"], None, "--compile does not run with --split yet: drop one of them"),
    (["--max-length", "20"], None, "--max-length and --constant-length apply to --lengths (groups stay whole)"),
    # The rollouts: too few for a warm-up and a measured RL step, groups of different sizes in one
    # step, numbers that are not plain digits, a file that is not text.
    (["--prompts-per-step", "8"], None, "--rollouts ROLLOUTS holds 8 groups, 1 RL step(s) of --prompts-per-step 8; a run needs 2 (1 warm-up): lower --prompts-per-step or add rollouts"),
    (["--prompts-per-step", "2"], "0 5 9\n0 5 9\n1 5 9\n1 5 9\n1 5 9\n2 5 9\n2 5 9\n3 5 9\n3 5 9\n", "--rollouts ROLLOUTS: RL step 1's minibatches hold 2 and 3 rollouts: every group needs the same number of responses"),
    ([], "0 5 9\n0 ٥ 9\n", "ROLLOUTS:2: expected 'group prompt_tokens response_tokens' (whole numbers, digits 0-9), got '0 ٥ 9'"),
    ([], "0 5 1_0\n", "ROLLOUTS:1: expected 'group prompt_tokens response_tokens' (whole numbers, digits 0-9), got '0 5 1_0'"),
    ([], "0 +5 9\n", "ROLLOUTS:1: expected 'group prompt_tokens response_tokens' (whole numbers, digits 0-9), got '0 +5 9'"),
    ([], b"0 5 9\n\xff\n", "ROLLOUTS: not UTF-8 text (invalid start byte at byte 6)"),
    (["--rollouts", "/no/such/rollouts.tsv"], None, "--rollouts /no/such/rollouts.tsv: No such file or directory"),
]  # fmt: skip


@pytest.mark.parametrize("extra, rollouts, message", _GRPO_REFUSALS)
def test_cli_task_grpo_refuses_bad_input_before_torch(
    tmp_path, monkeypatch, capsys, extra, rollouts, message
):
    """Exit 2 and one line naming the option, before torch is imported (made unimportable here:
    a check after the import would exit 1, "needs PyTorch") or any rank starts."""
    import sys

    from odc.train.__main__ import main

    path = tmp_path / "rollouts.tsv"
    content = _EIGHT_GROUPS if rollouts is None else rollouts
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)
    argv = ["--task", "grpo", "--rollouts", "rollouts.tsv", "--device", "cpu", "--ranks", "2",
            "--cost", "1,0.01,0", "--prompts-per-step", "4", *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = "python -m odc.train: error: " + message.replace("ROLLOUTS", "rollouts.tsv")
    assert err.splitlines() == [expected] or err.splitlines() == [expected + " (see --help)"], err


def test_cli_task_grpo_takes_rollouts_only_with_it(monkeypatch, capsys):
    import sys

    from odc.train.__main__ import main

    monkeypatch.setitem(sys.modules, "torch", None)
    for argv in (["--task", "grpo", "--lengths", "x.txt"], ["--rollouts", "x.tsv"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == [
            "python -m odc.train: error: --task grpo reads --rollouts (and --rollouts is for "
            "--task grpo)"
        ]


def _check_runs(runs, path):
    """Every arm on the same rollouts: the same arithmetic, so the same losses, gradient norms
    and entropies step by step; forward-only phases timed; LB-Micro padded to equal
    counts; and the first update's loss exactly -sum(advantage x response tokens) / the
    minibatch's response tokens: it runs on the policy that computed the old log-probabilities
    (ratio 1), whose reference is that same initial policy (KL 0)."""
    from odc.train import grpo

    collective = runs[0]
    for run in runs:
        assert len(run["losses"]) == 4  # 2 RL steps (1 warm-up) x K = 2 update minibatches
        (first, second) = run["rl"]["phase_seconds"]
        # The planner's span of each RL step's forward-only minibatch, with the forward cost.
        assert len(run["rl"]["predicted_phase_seconds"]) == 2
        assert all(p > 0 for p in run["rl"]["predicted_phase_seconds"])
        assert first["old_logprobs"] > 0 and first["ref_logprobs"] > 0
        # A random tiny model: entropy near ln(vocab) = ln(1024) = 6.93 nats per token.
        assert all(6.0 < e < 7.0 for e in run["rl"]["entropy"])
    for run in runs[1:]:
        assert run["losses"] == pytest.approx(collective["losses"], rel=1e-4, abs=1e-6)
        assert run["grad_norms"] == pytest.approx(collective["grad_norms"], rel=1e-4)
        assert run["rl"]["entropy"] == pytest.approx(collective["rl"]["entropy"], rel=1e-5)
    assert all(len({len(r) for r in mb}) == 1 for mb in collective["microbatch_log"])
    rollouts = grpo.read_rollouts(str(path))
    step = rollouts[:16]  # 4 prompts of 4 responses
    advantages = grpo.group_advantages(grpo.synthetic_rewards(step), [r.group for r in step])
    first = range(8)  # the first update minibatch: 2 of the step's 4 groups
    tokens = sum(step[i].response_tokens for i in first)
    expected = -sum(advantages[i] * step[i].response_tokens for i in first) / tokens
    for run in runs:
        assert run["losses"][0] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_forward_cost_scales_every_term_by_the_forward_share():
    from odc.train.grpo_run import FORWARD_FRACTION, _forward_costs

    assert _forward_costs((4.0, 8.0, 12.0, 16.0), True) == (1.0, 2.0, 3.0, 4.0)
    assert FORWARD_FRACTION[False] == pytest.approx(1 / 3)


_STUBBED_COMPILE = """
import sys
import odc.train.model as model
model.compile_blocks = lambda blocks, **options: True  # the flag only: the plain path runs
from odc.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.long
def test_compile_warm_up_runs_every_size_and_leaves_the_run_unchanged(tmp_path):
    # With compiled blocks, every arm first runs one forward + backward per size of
    # model.compile_sizes (and GRPO's forward-only passes), its sums dropped, so that torch
    # compiles outside the measured minibatches. On the CPU the blocks never compile: the stub
    # reports them compiled, so the warm-up runs on the plain path, and the run must train as
    # one without it (the same losses and gradient norms). The ODC arm: its warm-up opens the
    # engine's minibatch for the updates, then one per model for the forward-only passes.
    import json
    import os
    import socket
    import subprocess
    import sys

    path = _rollouts(tmp_path / "rollouts.tsv")
    runs = {}
    for stubbed in (False, True):
        with socket.socket() as probe:  # two ranks "started by torchrun", started here
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        output = tmp_path / f"stubbed_{stubbed}.json"
        argv = ["--preset", "tiny", "--device", "cpu", "--cost", "1,0.01,0", "--task", "grpo",
                "--rollouts", str(path), "--prompts-per-step", "4", "--steps", "1",
                "--comm", "odc", "--policy", "lb-mini", "--output", str(output),
                "--timeline", ""]  # fmt: skip
        command = [sys.executable] + (["-c", _STUBBED_COMPILE] if stubbed else ["-m", "odc.train"])
        ranks = [
            subprocess.Popen(
                command + argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
                env=dict(
                    os.environ,
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                ),
            )  # fmt: skip
            for rank in range(2)
        ]
        outputs = [rank.communicate(timeout=600) for rank in ranks]
        for rank, (_, stderr) in zip(ranks, outputs):
            assert rank.returncode == 0, stderr[-3000:]
        assert ("compiling the blocks for every size" in outputs[0][1]) == stubbed
        runs[stubbed] = json.loads(output.read_text())
    assert len(runs[False]) == len(runs[True]) == 1  # one run each: the ODC arm
    for plain, warmed in zip(runs[False], runs[True]):
        assert warmed["compiled_blocks"] and not plain["compiled_blocks"]
        assert warmed["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        assert warmed["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)
