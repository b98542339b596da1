"""`python -m odc.train` under torchrun (env:// rendezvous, communicators from the process group)
gives the same results and JSON as the self-launched run (CPU, tiny preset, 2 ranks)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="odc train needs torch")
pytest.importorskip("transformers", reason="odc train needs transformers")

REPO = Path(__file__).resolve().parents[2]
ARGUMENTS = [
    "--lengths", str(REPO / "data" / "aime_rl_like.txt"), "--device", "cpu", "--preset", "tiny",
    "--length-scale", "0.004", "--steps", "1", "--samples-per-rank", "3", "--compare",
    "--cost", "1,0,0", "--timeline", "",
]  # fmt: skip


def _torchrun():
    beside_python = Path(sys.executable).parent / "torchrun"
    path = str(beside_python) if beside_python.is_file() else shutil.which("torchrun")
    if not path:
        pytest.skip("torchrun is not installed")
    return [path, "--standalone", "--nproc_per_node", "2"]


def _run(command, cwd):
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=cwd, env=environment
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.long
def test_torchrun_and_self_launch_give_the_same_results(tmp_path):
    launched = tmp_path / "self.json"
    _run(
        [sys.executable, "-m", "odc.train", "--ranks", "2", *ARGUMENTS, "--output", str(launched)],
        tmp_path,
    )
    torchrun = tmp_path / "torchrun.json"
    result = _run(
        [*_torchrun(), "-m", "odc.train", *ARGUMENTS, "--output", str(torchrun)], tmp_path
    )
    assert result.stdout.count("planner cost model") == 1  # one table: rank 0 reports, rank 1 not
    runs_self, runs_torchrun = json.loads(launched.read_text()), json.loads(torchrun.read_text())
    assert [(r["comm"], r["policy"]) for r in runs_torchrun] == [
        ("collective", "lb-micro"),
        ("odc", "lb-mini"),
    ]
    for a, b in zip(runs_self, runs_torchrun):
        assert sorted(a) == sorted(b)  # the same JSON fields
        assert a["ranks"] == b["ranks"] == 2
        assert a["losses"] == b["losses"]  # same data, weights and sums: bit for bit on the CPU
        assert [len(m) for m in a["timeline"]] == [len(m) for m in b["timeline"]]


def test_torchrun_world_size_must_match_ranks(tmp_path):
    command = [*_torchrun(), "-m", "odc.train", "--ranks", "3", *ARGUMENTS]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment
    )
    assert result.returncode != 0
    assert "--ranks 3, but torchrun started 2" in result.stderr
