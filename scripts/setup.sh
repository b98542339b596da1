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
  # Without -q: pip shows each download with a progress bar, so the long ones are visible.
  "$venv/bin/python" -m pip install --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install --disable-pip-version-check packaging "${python_packages[@]}"
  echo "setup: Python packages installed in $venv"
else
  echo "setup: Python packages present in $venv"
fi
