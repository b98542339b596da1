"""Shared fixtures: the `odc` command-line tool and the shipped sample data."""

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def odc_cli() -> str:
    beside_python = Path(sys.executable).parent / "odc"  # a virtual environment's scripts
    path = os.environ.get("ODC_CLI") or shutil.which("odc")
    if not path and beside_python.is_file():
        path = str(beside_python)
    if not path:
        pytest.fail("the odc tool is not installed: run scripts/build.sh or set ODC_CLI")
    return path


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return REPO / "data"
