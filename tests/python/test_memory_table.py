"""docs/multinode.md's "Does it fit?" table is scripts/memory_table.py's output, row for row, so
the documented numbers follow the simulator's memory_per_gpu when its formulas change."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_documented_table_is_the_scripts_output(odc_cli):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "memory_table.py"), "--odc", odc_cli],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 3 * 3, done.stdout  # header, rule, 3 models x 3 GPU counts
    documented = (REPO / "docs" / "multinode.md").read_text().splitlines()
    missing = [row for row in rows if row not in documented]
    assert not missing, "rerun scripts/memory_table.py and update docs/multinode.md:\n" + "\n".join(
        missing
    )
