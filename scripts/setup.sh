#!/usr/bin/env bash
# Installs everything odc needs to build, test and run its demo, idempotently: Debian packages
# (compiler, CMake, GoogleTest, clang-format) and a Python virtual environment in .venv with the
# build backend and test tools. Safe to run any number of times; fast when nothing is missing.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

apt_packages=(build-essential cmake ninja-build libgtest-dev clang-format python3 python3-venv python3-pip)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  echo "setup: apt-get update"
  "${sudo_cmd[@]}" apt-get update -q
  # Not -qq: apt prints one line per package downloaded and set up, so a long install shows progress.
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
  echo "setup: Debian packages installed"
else
  echo "setup: Debian packages present (${apt_packages[*]})"
fi

# The Python environment. Any python3 >= 3.9 on PATH will do (a pyenv one, or Debian's).
venv="$repo_root/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
# torch is pinned to the minor version odc.torch was checked against (python/odc/torch);
# transformers provides the Qwen2 model of `python -m odc.train`, matplotlib its plots, tqdm its
# progress bars (optional: without it plain progress lines are printed).
python_packages=("scikit-build-core>=0.8" "numpy>=1.22" "pytest>=7" "ruff==0.8.4" "torch>=2.11,<2.12" "transformers>=5,<6" "matplotlib>=3.7" "tqdm>=4.60")
if ! "$venv/bin/python" - "${python_packages[@]}" <<'PY' >/dev/null 2>&1; then
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    requirement = Requirement(spec)
    assert requirement.specifier.contains(version(requirement.name), prereleases=True)
PY
  echo "setup: installing Python packages: ${python_packages[*]}"
  echo "setup: (torch is the big one: its download, a few hundred MB to a few GB, is what PyPI serves)"
  "$venv/bin/python" -m pip install --disable-pip-version-check --upgrade pip
  # pip prints a line per package, but downloading and unpacking torch and its CUDA libraries
  # takes minutes without a line: a heartbeat says so whenever pip has been quiet for 10 s.
  pip_log="$venv/setup-pip.log"
  : >"$pip_log"
  (
    last_size=-1 quiet=0
    while sleep 10; do
      size=$(stat -c %s "$pip_log" 2>/dev/null || echo 0)
      if [[ "$size" == "$last_size" ]]; then
        quiet=$((quiet + 10))
        echo "setup: pip is still downloading/installing (${quiet} s since its last line)"
      else
        quiet=0
      fi
      last_size=$size
    done
  ) &
  heartbeat=$!
  set +e
  "$venv/bin/python" -m pip install --disable-pip-version-check packaging "${python_packages[@]}" 2>&1 |
    tee "$pip_log"
  pip_status=${PIPESTATUS[0]}
  set -e
  kill "$heartbeat" 2>/dev/null || true
  wait "$heartbeat" 2>/dev/null || true
  if ((pip_status != 0)); then
    echo "setup: error: pip failed (exit $pip_status); its output is in $pip_log" >&2
    exit "$pip_status"
  fi
  echo "setup: Python packages installed in $venv"
else
  echo "setup: Python packages present in $venv"
fi
