"""dev/gpu/run.sh's GPU-suite shards (gpu-suite-1..3) together name every test file of tests/gpu,
each once, so that running the shards runs the whole suite."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_gpu_test_file_is_in_exactly_one_shard():
    script = (ROOT / "dev" / "gpu" / "run.sh").read_text()
    shards = re.findall(r"gpu_suite_shard pytest-gpu-\d((?:\s+(?:\\\n)?\s*test_\w+\.py)+)", script)
    named = [name for shard in shards for name in re.findall(r"test_\w+\.py", shard)]
    files = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert len(shards) == 3, f"expected 3 shards in dev/gpu/run.sh, found {len(shards)}"
    assert sorted(named) == files, f"shards name {sorted(named)}, tests/gpu holds {files}"
