"""`python -m odc.fit` (python/odc/fit.py) on the CPU: a tiny Qwen2 config gives a `--cost A,B,C,F`
line that `odc plan` takes, bad input is one line with exit status 2, and a length that runs out
of memory ends the ladder there. Times are never asserted, only their shape."""

import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from odc import fit  # noqa: E402
from odc._cost_fit import fitted_rungs, floor_length, ladder, packed_ladder  # noqa: E402

MAX_TOKENS = 128  # ladder 16..128 and a 4-token floor: milliseconds per microbatch on a CPU
TINY = dict(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_fit_prints_a_cost_the_planner_takes(config_path, odc_cli, tmp_path):
    out = tmp_path / "fit.json"
    command = [sys.executable, "-m", "odc.fit", str(config_path), "--device", "cpu"]
    command += ["--dtype", "float32", "--max-tokens", str(MAX_TOKENS), "--repeats", "2"]
    result = subprocess.run(
        command + ["--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    flag, value = lines[-1].split(" ")
    assert flag == "--cost"
    cost = [float(v) for v in value.split(",")]
    assert len(cost) == 4 and all(math.isfinite(v) and v >= 0 for v in cost)
    assert cost[3] > 0  # the floor: a microbatch always takes some time
    # The table: a header, the floor's row, one row per length of the ladder, then the packed
    # rungs (the model is built with odc.train's packed attention, which keeps documents apart).
    packed = packed_ladder(MAX_TOKENS)
    table = [line.split()[0] for line in lines if line.split()[0].isdigit()]
    single = [floor_length(MAX_TOKENS), *ladder(MAX_TOKENS)]
    assert table == [str(n) for n in single + [sum(p) for p in packed]]
    assert sum("packed:" in line for line in lines) == len(packed) == 4
    written = json.loads(out.read_text())
    assert written["flag"] == lines[-1] and written["settings"]["packed_rungs"] is True
    assert [r.get("documents") for r in written["ladder"]] == [None] * (len(single) - 1) + packed
    assert all(len(rung["times"]) == 2 for rung in written["ladder"])

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [5, 120, 17, 64, 33, 90, 8, 40]) + "\n")
    plan = subprocess.run(
        [odc_cli, "plan", "--lengths", str(lengths), "--ranks", "2", "--max-tokens",
         str(MAX_TOKENS), "--policy", "lb-mini", flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["cost"]
    assert planned["floor"] == pytest.approx(cost[3])
    assert [planned[k] for k in "abc"] == pytest.approx(cost[:3])


def _error(capsys, *argv) -> str:
    assert fit.main(list(argv)) == fit.USAGE_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line(config_path, capsys, tmp_path, monkeypatch):
    cpu = ["--device", "cpu", "--dtype", "float32"]
    assert "no such config" in _error(capsys, str(tmp_path / "nope.json"), "--max-tokens", "64")
    assert "local Hugging Face cache" in _error(capsys, "no-such-org-xyz", "--max-tokens", "64")
    assert "at least 8" in _error(capsys, str(config_path), "--max-tokens", "4", *cpu)
    assert "1024 positions" in _error(capsys, str(config_path), "--max-tokens", "4096", *cpu)
    assert "bfloat16 or float32" in _error(
        capsys, str(config_path), "--max-tokens", "64", "--device", "cpu", "--dtype", "fp8"
    )
    not_a_config = tmp_path / "other.json"
    not_a_config.write_text('{"hidden_size": 8}')
    assert "model_type" in _error(capsys, str(not_a_config), "--max-tokens", "64", *cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU" in _error(capsys, str(config_path), "--max-tokens", "64")


# Configs transformers refuses (its validators raise types of their own), configs it takes but
# cannot build or run, and the integer options: one line each, status 2 (each was a traceback).
_REFUSED_CONFIGS = [
    (dict(hidden_size="abc"), "Field 'hidden_size' expected int, got str (value: 'abc')"),
    (dict(num_hidden_layers=-1), "`num_hidden_layers` (-1) must be equal to the number of"),
    (dict(num_attention_heads=0), "cannot build a causal LM from this config: integer division"),
    (dict(hidden_size=-32), "cannot build a causal LM from this config: Trying to create tensor "
                            "with negative dimension -32"),
    (dict(hidden_act="nope"), "cannot build a causal LM from this config: unknown name 'nope'"),
    (dict(vocab_size=0), "the vocabulary size must be a positive integer, got 0"),
    (dict(hidden_size=30), "forward + backward of 16 tokens failed: The size of tensor a (7) "
                           "must match the size of tensor b (8)"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", _REFUSED_CONFIGS)
def test_config_transformers_refuses_is_one_line(tmp_path, capsys, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **change}))
    argv = [str(path), "--max-tokens", "64", "--device", "cpu", "--dtype", "float32"]
    assert fit.main(argv + ["--repeats", "1", "--warmup", "0"]) == fit.USAGE_ERROR
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("python -m odc.fit: error: ")]
    assert "Traceback" not in err and errors == [err.splitlines()[-1]], err
    assert message in errors[0], err


def test_failed_allocation_of_the_model_is_one_line(config_path, capsys, monkeypatch):
    # What the CPU allocator raises for weights that do not fit (a real one would take the
    # machine's memory first): one line with the size it tried, not a traceback.
    import transformers

    def no_memory(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 17592186044416 bytes. Error code 12"
        )

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_memory)
    assert fit.main([str(config_path), "--max-tokens", "64", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m odc.fit: error: out of memory building the model on cpu (it tried to allocate "
        "17592186044416 bytes): a smaller config, --dtype bfloat16 or a larger device"
    )


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--max-tokens", "6\u0664", "argument --max-tokens: expected a whole number (digits 0-9)"),
        ("--repeats", "1_0", "argument --repeats: expected a whole number (digits 0-9)"),
        ("--seed", "18446744073709551616", "seed must be 0 to 2^64 - 1"),
    ],
)
def test_integer_options_take_plain_digits(config_path, capsys, option, value, message):
    argv = [str(config_path), "--max-tokens", "64", "--device", "cpu", option, value]
    assert message in _error(capsys, *argv)


def test_unwritable_json_fails_before_the_fit(config_path, capsys, tmp_path, monkeypatch):
    # The fit takes minutes on a real model: a --json path that cannot be written is refused
    # first, in one line with status 2, and the fit never starts.
    def no_fit(*args, **kwargs):
        raise AssertionError("the fit ran although --json cannot be written")

    monkeypatch.setattr(fit, "fit_cost", no_fit)
    cpu = [str(config_path), "--max-tokens", "64", "--device", "cpu"]
    missing = tmp_path / "no" / "such" / "dir" / "x.json"
    assert "no directory" in _error(capsys, *cpu, "--json", str(missing))
    assert "a directory" in _error(capsys, *cpu, "--json", str(tmp_path))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root writes anywhere
        assert "not writable" in _error(capsys, *cpu, "--json", str(locked / "x.json"))


class _RunsOutOfMemory(torch.nn.Module):
    """Raises the allocator's error for inputs longer than `limit` tokens."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.embed = torch.nn.Embedding(11, 4)

    def forward(self, input_ids):
        if input_ids.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return self.embed(input_ids)


def test_out_of_memory_ends_the_ladder():
    lengths = ladder(256)
    model = _RunsOutOfMemory(limit=lengths[3])
    result = fit.fit_cost(model, 256, vocab_size=11, repeats=1, warmup=0)
    assert [r.tokens for r in result.rungs] == lengths[:4]
    assert result.stopped == f"out of memory at {lengths[4]} tokens: the ladder stops there"
    assert result.flag.startswith("--cost ")
    with pytest.raises(fit.FitError, match=f"out of memory at {lengths[2]} tokens.*needs 3"):
        fit.fit_cost(_RunsOutOfMemory(limit=lengths[1]), 256, vocab_size=11, repeats=1)
    with pytest.raises(fit.FitError, match="vocab_size"):
        fit.fit_cost(model, 256)
    with pytest.raises(fit.FitError, match="the model is on cpu, not cuda"):
        fit.fit_cost(model, 256, vocab_size=11, device="cuda")  # a module is used where it is


def test_model_object_with_gradient_checkpointing(config_path):
    """The function API on a transformers model object: gradient checkpointing on, weights left
    as they were (no optimizer step), gradients dropped."""
    config = fit.load_config(config_path)
    model = fit.build_model(config, torch.device("cpu"), torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    result = fit.fit_cost(model, 64, gradient_checkpointing=True, repeats=1)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert len(result.rungs) == len(ladder(64))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_host_bound_rungs_are_marked():
    # The rungs calibrate fits a, b, c on: those at least 1.5x the floor, or all when < 3 are.
    assert fitted_rungs([0.3, 0.31, 0.5, 0.9, 2.0], 0.3) == [2, 3, 4]
    assert fitted_rungs([0.3, 0.31, 0.5, 0.9], 0.3) == [0, 1, 2, 3]
