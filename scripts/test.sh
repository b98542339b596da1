#!/usr/bin/env bash
# The test command of the README and CI: setup, the one build, then the C++ tests (ctest) and the
# Python tests (pytest, including the code blocks of README.md and docs/*.md; GPU tests are
# reported as skipped where no GPU is present).
#
#   ./scripts/test.sh          the quick tier: every test but the long ones below
#   ./scripts/test.sh --full   every test: what CI (.ci/run) runs
#
# The long ones: the protocol at 256 ranks for 1,000 minibatches per scheme (ctest, names with
# _256ranks: about 660 s of CPU, 5.5 min of a 2-core machine; their 2- and 64-rank runs stay
# in the quick tier), whole odc.train runs and the slow variants of quick tests (pytest's `long`
# mark, doc blocks marked `doc-test: long`; pyproject.toml says which), and odc.verl's tests
# against verl itself (tests/python/test_verl_backend.py in .venv-verl, scripts/setup_verl.sh;
# without verl they skip). The quick tier took 9 min 9 s on a fresh clone of a 2-core machine,
# setup and build included.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
tier=quick
case "${1:-}" in
  "") ;;
  --full) tier=full ;;
  *) echo "usage: ./scripts/test.sh [--full]  (got '$1')" >&2; exit 2 ;;
esac
build_dir="${ODC_BUILD_DIR:-build/cmake}"
started=$SECONDS
phase() { echo; echo "== [$((SECONDS - started)) s] $* =="; }
ctest_filter=() pytest_filter=()
if [ "$tier" = quick ]; then
  ctest_filter=(-E '_256ranks')  # names carry a '# GetParam() = ...' suffix
  pytest_filter=(-m 'not long')
fi

phase "setup"
scripts/setup.sh
verl_setup_pid=""
if [ "$tier" = full ]; then
  # verl's environment (scripts/setup_verl.sh: mostly downloads) installs in the background
  # while the build and the tests below keep both cores busy; its tests run last.
  mkdir -p build
  scripts/setup_verl.sh >build/setup_verl.log 2>&1 &
  verl_setup_pid=$!
  echo "setup: verl's environment (.venv-verl) installing in the background: build/setup_verl.log"
fi
phase "build"
scripts/build.sh
phase "C++ tests (ctest, $tier tier)"
ctest --test-dir "$build_dir" --output-on-failure --timeout 300 -j "$(nproc)" --progress \
  "${ctest_filter[@]}"
phase "Python tests (pytest)"
# --durations: the slowest tests in every log, where CI's time goes.
ODC_CLI="$repo_root/.venv/bin/odc" .venv/bin/python -m pytest -rs --durations=15 tests/python \
  tests/gpu "${pytest_filter[@]}"
if [ -n "$verl_setup_pid" ]; then
  phase "odc as a verl backend (pytest with .venv-verl: verl $(sed -n 's/.*"verl==\(.*\)".*/\1/p' pyproject.toml))"
  if ! wait "$verl_setup_pid"; then
    cat build/setup_verl.log
    echo "scripts/setup_verl.sh failed (log above)" >&2
    exit 1
  fi
  tail -n 1 build/setup_verl.log
  .venv-verl/bin/python -m pytest -rs tests/python/test_verl_backend.py
fi
phase "tests done ($tier tier)"
if [ "$tier" = quick ]; then
  echo "the long tests did not run: ./scripts/test.sh --full runs them (as CI does)"
fi
