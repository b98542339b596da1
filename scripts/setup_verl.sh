#!/usr/bin/env bash
# Installs verl (the version odc.verl is tested against, pyproject's `verl` extra) into
# .venv-verl, a virtual environment layered on .venv: it sees .venv's packages (torch, odc) through
# a .pth file and holds only what verl adds, or pins differently (transformers < 5.11), in front of
# them. verl cannot go into .venv itself: its transformers pin would replace the one odc.train
# and the other tests run with. Idempotent; about 3 minutes and 900 MB the first time (ray,
# pyarrow, pandas, transformers, wandb, ...), seconds after. The full test tier (CI) runs
# tests/python/test_verl_backend.py with .venv-verl/bin/python.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
venv="$repo_root/.venv-verl"
base_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
verl_pin=$(.venv/bin/python - <<'PY'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(next(r for r in extras["verl"] if re.match(r"verl\b", r)))
PY
)
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup_verl: creating $venv on top of .venv"
  .venv/bin/python -m venv "$venv"
fi
own_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$own_site/odc-base-venv.pth"
if "$venv/bin/python" - "$verl_pin" <<'PY' >/dev/null 2>&1; then
import sys
from importlib.metadata import version
assert f"verl=={version('verl')}" == sys.argv[1]
import verl  # noqa: F401  (odc itself may not be installed yet: the tests import odc.verl)
PY
  echo "setup_verl: $verl_pin present in $venv"
  exit 0
fi
echo "setup_verl: installing $verl_pin into $venv (the packages .venv already has stay there)"
# --progress-bar off, not -q: a long download still prints a line per package.
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$verl_pin"
# verl only: the full tier runs this beside scripts/build.sh, which installs odc into .venv later.
"$venv/bin/python" -c 'import verl; from importlib.metadata import version; print("setup_verl: verl", version("verl"), "transformers", version("transformers"))'
