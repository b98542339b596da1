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


def _imports_outside_functions(tree):
    """Every import of a module at load time (not inside a function: those run on demand)."""
    lazy = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.ImportFrom):
            yield ("." * node.level) + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_the_shared_modules_import_nothing_above_them():
    # The packed attention loads odc.torch's split attention only when a split chunk comes in.
    for name in ("_cost_fit.py", "_numbers.py", "_packed_attention.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        for target in _imports_outside_functions(tree):
            assert not target.startswith((".train", ".fit", ".torch", "odc")), (name, target)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                assert not node.module.startswith(("train", "fit")), (name, node.module)


def test_the_cost_fits_packed_attention_loads_nothing_of_odc_train():
    code = (
        "import sys\n"
        "import odc.fit\n"
        "from odc._packed_attention import register_packed_attention\n"
        "register_packed_attention()\n"
        "loaded = sorted(m for m in sys.modules if m == 'odc.train' or m.startswith('odc.train.'))\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the packed attention loaded {result.stdout.strip()}"
