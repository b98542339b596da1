#!/usr/bin/env bash
# Fails when a C++ or Python file is not formatted (clang-format per .clang-format; ruff format).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
mapfile -t cxx_files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh' ':!:third_party/**')
clang-format --dry-run --Werror "${cxx_files[@]}"
mapfile -t py_files < <(git ls-files '*.py' ':!:third_party/**')
.venv/bin/ruff format --check "${py_files[@]}"
echo "format: ${#cxx_files[@]} C++ and ${#py_files[@]} Python files clean"
