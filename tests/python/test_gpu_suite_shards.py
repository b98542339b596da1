"""dev/gpu/run.sh's GPU-suite shards (gpu-suite-1..6) together run every test of tests/gpu, each
once, so that running the shards runs the whole suite. A file split over several shards by
pytest's -k expressions is checked by collecting it once per expression: the selections must
not overlap and must together hold every test of the file."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARD = re.compile(r'gpu_suite_shard pytest-gpu-(\d) "([^"]*)"((?:\s+(?:\\\n)?\s*test_\w+\.py)+)')


def _shards():
    script = (ROOT / "dev" / "gpu" / "run.sh").read_text()
    return [
        (int(number), select, re.findall(r"test_\w+\.py", names))
        for number, select, names in SHARD.findall(script)
    ]


def _collected(file_name, select):
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-k", select] if select else []
    result = subprocess.run(
        [*command, str(ROOT / "tests" / "gpu" / file_name)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: nothing selected
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_every_gpu_test_is_in_exactly_one_shard():
    shards = _shards()
    assert [number for number, _, _ in shards] == list(range(1, 7)), shards
    files = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert sorted({name for _, _, names in shards for name in names}) == files

    selections = {}  # file -> the -k expressions of the shards that name it
    for _, select, names in shards:
        for name in names:
            selections.setdefault(name, []).append(select)
    for name, selects in selections.items():
        if selects == [""]:
            continue  # the whole file in one shard
        assert "" not in selects, f"{name} is in one shard whole and in others in part"
        every = _collected(name, "")
        assert every, f"collecting {name} found no tests"
        chosen = [_collected(name, select) for select in selects]
        for select, tests in zip(selects, chosen):
            assert tests, f"-k {select!r} selects nothing of {name}"
        assert sum(len(tests) for tests in chosen) == len(every), (
            f"{name}: the shards' selections overlap or miss tests "
            f"({[len(t) for t in chosen]} of {len(every)})"
        )
        assert set().union(*chosen) == every
