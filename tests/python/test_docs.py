"""Every complete code block of README.md, CONTRIBUTING.md and docs/**/*.md runs, exactly as
written. The marking convention (CONTRIBUTING.md, "Code blocks in the docs"):

  ```python / ```bash          a complete program or command list: run here (cwd: a scratch copy
                               of the repository's top level; `python` and `odc` on PATH)
  <!-- doc-test: fragment -->  on the line before the fence: part of a program; only its syntax is
                               checked (python: compile, bash: bash -n)
  <!-- doc-test: gpu -->       needs 2+ GPUs and libodc built with CUDA: run there, skipped
                               (and reported) elsewhere
  <!-- doc-test: manual: WHY --> not run by this test (the reason is required and reported): the
                               README's own commands, long GPU benchmarks, builds from scratch
  <!-- doc-test: long -->      a complete block of a minute on a 2-core machine: runs in the full
                               tier (pytest's `long` mark; ./scripts/test.sh leaves it out)
  ```text / ```json / ``` ...  output and formats: not code, not run

Blocks in any other language (c, cpp, ...) must carry a marker. Files added later are picked up
by the glob, so new docs follow the same rule without touching this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DATA_LANGUAGES = {"", "text", "txt", "json", "csv", "output", "console", "diff", "toml", "yaml"}
MARKER = re.compile(r"^<!--\s*doc-test:\s*(fragment|gpu|manual|long)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    marker: str  # "" | "fragment" | "gpu" | "manual" | "long" | "bad: ..."
    reason: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files():
    files = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def parse_blocks(path: Path):
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, language = match.group(1), match.group(2).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        previous = next(
            (lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), ""
        )
        marker, reason = "", ""
        if previous.startswith("<!--") and "doc-test" in previous:
            found = MARKER.match(previous)
            if not found:
                marker = f"bad: unknown doc-test marker {previous!r}"
            else:
                marker, reason = found.group(1), found.group(2) or ""
                if marker == "manual" and not reason:
                    marker = (
                        "bad: 'doc-test: manual' needs a reason: <!-- doc-test: manual: WHY -->"
                    )
        blocks.append(Block(path, start + 1, language, marker, reason, "\n".join(body) + "\n"))
    return blocks


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]
CODE_BLOCKS = [b for b in ALL_BLOCKS if b.language not in DATA_LANGUAGES or b.marker]


def _gpu_skip_reason():
    import odc

    if not odc.has_cuda():
        return "libodc was built without CUDA"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return f"needs 2 or more CUDA devices, found {torch.cuda.device_count()}"
    return None


@pytest.fixture(scope="module")
def scratch_repo(tmp_path_factory):
    """A directory that looks like the repository's top level (symlinks), so blocks that write
    files (runs/, results) write them here, not into the checkout."""
    root = tmp_path_factory.mktemp("docs")
    for entry in REPO.iterdir():
        if entry.name not in {".git", "runs", ".venv"}:
            (root / entry.name).symlink_to(entry)
    return root


def _environment(odc_cli: str) -> dict:
    env = dict(os.environ)
    path = [str(Path(odc_cli).resolve().parent), str(Path(sys.executable).parent)]
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    env["ODC_PYTHON"] = sys.executable  # the interpreter `odc compare --plot` draws with
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def test_markers_are_well_formed():
    bad = [f"{b.name}: {b.marker[5:]}" for b in ALL_BLOCKS if b.marker.startswith("bad: ")]
    unmarked = [
        f"{b.name}: a '{b.language}' block needs a doc-test marker (fragment, gpu or manual)"
        for b in ALL_BLOCKS
        if b.language not in RUN_LANGUAGES and b.language not in DATA_LANGUAGES and not b.marker
    ]
    assert not bad + unmarked, "\n".join(bad + unmarked)


def test_there_are_blocks_to_run():
    runnable = [b for b in CODE_BLOCKS if b.language in RUN_LANGUAGES and b.marker in ("", "long")]
    assert len(runnable) >= 3, [b.name for b in runnable]  # the parser did not lose the README's


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=pytest.mark.long) if b.marker == "long" else b for b in CODE_BLOCKS],
    ids=lambda b: b.name,
)
def test_doc_block(block, odc_cli, scratch_repo, tmp_path):
    language = RUN_LANGUAGES.get(block.language)
    if block.marker.startswith("bad: "):
        pytest.fail(block.marker[5:])
    if block.marker == "manual":
        pytest.skip(f"manual: {block.reason}")
    if block.marker == "fragment":
        if language == "python":
            compile(block.code, block.name, "exec")
        elif language == "bash":
            check = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
            assert check.returncode == 0, check.stderr
        return
    if block.marker == "gpu":
        reason = _gpu_skip_reason()
        if reason:
            pytest.skip(f"gpu block: {reason}")
    if language is None:
        pytest.fail(f"{block.name}: cannot run a '{block.language}' block; mark it")
    if language == "python":
        script = tmp_path / "doc_block.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    result = subprocess.run(
        command,
        cwd=scratch_repo,
        env=_environment(odc_cli),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"{block.name} failed (exit {result.returncode}):\n{block.code}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )


def test_license_matches_pyproject():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()
