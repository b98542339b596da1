#!/usr/bin/env bash
# The test command of the README and CI: setup, build, then the C++ tests (ctest) and the Python
# tests (pytest; GPU tests are reported as skipped where no GPU is present).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="${ODC_BUILD_DIR:-build/cmake}"

scripts/setup.sh
scripts/build.sh
ctest --test-dir "$build_dir" --output-on-failure --timeout 300 -j "$(nproc)"
ODC_CLI="$repo_root/.venv/bin/odc" .venv/bin/python -m pytest -q -rs tests/python tests/gpu
