#!/usr/bin/env bash
# Builds the C++ library, the `odc` tool, tests and benchmarks ONCE, with CMake into build/cmake,
# then installs the Python package into .venv from that same build directory (scikit-build-core
# re-configures it, finds everything up to date and only installs libodc.so and `odc`): nothing is
# compiled twice. CUDA is compiled where a GPU is visible, or when ODC_WITH_CUDA=ON asks for it
# (CI does); the first line says which. Incremental: a second run takes seconds.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="${ODC_BUILD_DIR:-build/cmake}"

if [[ -n "${ODC_WITH_CUDA:-}" ]]; then
  with_cuda="$ODC_WITH_CUDA"
  reason="ODC_WITH_CUDA=$ODC_WITH_CUDA asks for it"
elif ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  with_cuda=OFF
  reason="no CUDA compiler (nvcc) found"
elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  with_cuda=OFF
  reason="nvcc found but no GPU; ODC_WITH_CUDA=ON compiles the CUDA code anyway"
else
  with_cuda=ON
  reason="$(nvidia-smi -L | grep -c '^GPU ') GPU(s) found"
fi
echo "build: CUDA $with_cuda ($reason); C++ into $build_dir, then the Python package into .venv"

# NVSHMEM needs CUDA. A build directory configured with CUDA keeps ODC_WITH_NVSHMEM=ON in its
# cache, which a later CUDA-off configure (`ODC_WITH_CUDA=ON scripts/test.sh`, then
# scripts/main.sh on a machine without a GPU) would refuse: it follows CUDA here, off with it,
# else recomputed (on where NVSHMEM is found).
nvshmem_args=(-UODC_WITH_NVSHMEM)
nvshmem_define=()
if [[ "$with_cuda" == OFF ]]; then
  nvshmem_args=(-DODC_WITH_NVSHMEM=OFF)
  nvshmem_define=(-Ccmake.define.ODC_WITH_NVSHMEM=OFF)
fi

# -U SKBUILD*: a previous pip install leaves scikit-build-core's variables in the cache; a plain
# configure must not inherit its install layout. The configure log is kept; its summary is shown.
mkdir -p "$build_dir"
if ! cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DODC_BUILD_TESTS=ON \
  -DODC_BUILD_BENCHMARKS=ON -DODC_WITH_CUDA="$with_cuda" -DODC_PYTHON="$PWD/.venv/bin/python" \
  "${nvshmem_args[@]}" -U 'SKBUILD*' ${ODC_CMAKE_ARGS:-} \
  >"$build_dir/configure.log" 2>&1; then
  cat "$build_dir/configure.log"
  echo "build: error: CMake configure failed (log above, also in $build_dir/configure.log)" >&2
  exit 1
fi
grep -E '^-- odc:' "$build_dir/configure.log" || true
echo "build: compiling ($(nproc) jobs)"
cmake --build "$build_dir" --parallel "$(nproc)"

echo "build: installing the Python package into .venv (from $build_dir, nothing recompiled)"
CMAKE_GENERATOR=Ninja .venv/bin/python -m pip install --no-build-isolation --no-deps \
  --disable-pip-version-check --progress-bar off \
  -Cbuild-dir="$build_dir" -Ccmake.define.ODC_BUILD_TESTS=ON \
  -Ccmake.define.ODC_BUILD_BENCHMARKS=ON -Ccmake.define.ODC_WITH_CUDA="$with_cuda" \
  "${nvshmem_define[@]}" "$repo_root"
.venv/bin/python -c "import odc; print(f'build: odc {odc.__version__} installed, CUDA transport:', odc.has_cuda())"
