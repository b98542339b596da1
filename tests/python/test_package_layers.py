"""The odc package's layers: the public cost fit (odc.fit) sits beside the benchmark app (odc.train),
not above it. Both take the least-squares fit and the strict option parsers from modules below them
(odc._cost_fit, odc._numbers), so importing odc.fit loads nothing of odc.train."""

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "odc"


def test_importing_odc_fit_loads_nothing_of_odc_train():
    code = (
        "import sys\n"
        "import odc.fit\n"
        "loaded = sorted(m for m in sys.modules if m == 'odc.train' or m.startswith('odc.train.'))\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import odc.fit loaded {result.stdout.strip()}"


def test_the_shared_fit_and_parsers_import_nothing_above_them():
    for name in ("_cost_fit.py", "_numbers.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert not target.startswith((".train", ".fit", ".torch", "odc.")), (name, target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("odc"), (name, alias.name)
