#!/usr/bin/env bash
# The test command of the README and CI: setup, the one build, then the C++ tests (ctest) and the
# Python tests (pytest, including the code blocks of README.md and docs/*.md; GPU tests are
# reported as skipped where no GPU is present).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="${ODC_BUILD_DIR:-build/cmake}"
started=$SECONDS
phase() { echo; echo "== [$((SECONDS - started)) s] $* =="; }

phase "setup"
scripts/setup.sh
phase "build"
scripts/build.sh
phase "C++ tests (ctest)"
ctest --test-dir "$build_dir" --output-on-failure --timeout 300 -j "$(nproc)" --progress
phase "Python tests (pytest)"
ODC_CLI="$repo_root/.venv/bin/odc" .venv/bin/python -m pytest -rs tests/python tests/gpu
phase "tests done"
