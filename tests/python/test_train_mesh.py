"""`python -m odc.train --mesh R,S` on the CPU (tiny preset, 2 "nodes" x 2 ranks): collective HSDP,
ODC hybrid and flat ODC run the same minibatches to the same losses, and the results carry the
mesh and the cross-replica reduction; bad meshes are refused with a message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="odc train needs torch")
pytest.importorskip("transformers", reason="odc train needs transformers")

REPO = Path(__file__).resolve().parents[2]
LENGTHS = str(REPO / "data" / "aime_rl_like.txt")


@pytest.mark.long
def test_mesh_compare_hybrid_collective_and_flat(tmp_path):
    output = tmp_path / "results.json"
    command = [
        sys.executable, "-m", "odc.train", "--lengths", LENGTHS, "--device", "cpu",
        "--preset", "tiny", "--length-scale", "0.004", "--steps", "1", "--samples-per-rank", "2",
        "--cost", "1,0,0", "--mesh", "2,2", "--compare", "--output", str(output), "--timeline", "",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cross-replica s" in result.stdout
    runs = json.loads(output.read_text())
    assert [(r["comm"], r["policy"], r["mesh"]) for r in runs] == [
        ("collective", "lb-micro", [2, 2]),
        ("odc", "lb-mini", [2, 2]),
        ("odc", "lb-mini", [1, 4]),
    ]
    collective, hybrid, flat = runs
    assert all(r["ranks"] == 4 and len(r["timeline"]) == 4 for r in runs)
    assert hybrid["replica_reduce_seconds"] > 0 and hybrid["replica_reduce_bytes"] > 0
    assert collective["replica_reduce_seconds"] is None and flat["replica_reduce_seconds"] is None
    assert flat["replica_reduce_bytes"] == 0
    # Same data, initialization and summed gradients (over all ranks of both nodes): the same
    # losses step by step, whatever the mesh and the microbatch counts.
    assert hybrid["losses"] == pytest.approx(collective["losses"], rel=1e-4)
    assert flat["losses"] == pytest.approx(collective["losses"], rel=1e-4)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--mesh", "2,2", "--ranks", "6"], "covers 4 ranks, not 6"),
        (["--mesh", "2"], "--mesh must be R,S"),
        (["--mesh", "4,1"], "needs R >= 1 replicas of S >= 2 ranks"),
    ],
)
def test_bad_mesh_is_refused(tmp_path, arguments, message):
    command = [sys.executable, "-m", "odc.train", "--lengths", LENGTHS, "--device", "cpu"]
    result = subprocess.run(
        command + arguments, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode != 0
    assert message in result.stderr
