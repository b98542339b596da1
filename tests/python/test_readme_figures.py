"""The README's generated figures (scripts/readme_figures.py) are what the planner prints now, so
they cannot go stale; and the check catches a README that drifted. Planner output only: no
timings. About a second (four `odc compare` runs)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "readme_figures.py"


def check(odc_cli: str, readme: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--odc", odc_cli, "--readme", str(readme), "--check"],
        capture_output=True,
        text=True,
    )


def test_readme_figures_are_what_the_planner_prints(odc_cli):
    done = check(odc_cli, REPO / "README.md")
    assert done.returncode == 0, done.stderr


def test_a_stale_figure_fails_the_check_and_names_the_fix(odc_cli, tmp_path):
    text = (REPO / "README.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("lb-mini "))
    stale = row.replace("(mean ", "(mean 9")  # a figure no planner run printed
    readme = tmp_path / "README.md"
    readme.write_text(text.replace(row, stale))
    done = check(odc_cli, readme)
    assert done.returncode == 1
    assert "scripts/readme_figures.py --write" in done.stderr
    assert f"-{stale}" in done.stderr and f"+{row}" in done.stderr
