#!/usr/bin/env bash
# Builds the C++ library, tool, tests and benchmarks into build/ (CMake), and installs the Python
# package (with its own copy of libodc.so and the `odc` tool) into .venv. Incremental.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="${ODC_BUILD_DIR:-build/cmake}"

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DODC_BUILD_TESTS=ON \
  -DODC_BUILD_BENCHMARKS=ON ${ODC_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" --parallel "$(nproc)"
.venv/bin/python -m pip install -q --no-build-isolation "$repo_root"
