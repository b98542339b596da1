"""odc.torch's modules form layers (errors and FSDP2 internals, the group, its collectives, the
engine, the package's __init__): no module imports one that imports it back. A circle makes the
order of imports matter and hides which module owns what (heap -> fsdp2 -> heap was one)."""

import ast
from pathlib import Path

PACKAGE = "odc.torch"
FOLDER = Path(__file__).resolve().parents[2] / "python" / "odc" / "torch"


def _imported(node: ast.AST, modules: set) -> set:
    """The modules of odc.torch that one import statement loads, by file stem ("__init__" for the
    package itself), relative or absolute, at module level or inside a function."""
    if isinstance(node, ast.Import):
        paths = [(alias.name, []) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative to odc.torch: level 1 is the package, 2 its parent (odc)
            parent = PACKAGE.split(".")[: len(PACKAGE.split(".")) - node.level + 1]
            base = ".".join(parent + ([node.module] if node.module else []))
        paths = [(base, [alias.name for alias in node.names])]
    else:
        return set()
    found = set()
    for path, names in paths:
        if path == PACKAGE:  # from odc.torch import x: the submodule x, else the package's name
            found.update(name if name in modules else "__init__" for name in names or ["__init__"])
        elif path.startswith(PACKAGE + "."):
            found.add(path[len(PACKAGE) + 1 :].split(".")[0])
    return found & modules


def _import_graph() -> dict:
    modules = {path.stem for path in FOLDER.glob("*.py")}
    return {
        name: set().union(
            *(_imported(node, modules) for node in ast.walk(ast.parse(path.read_text())))
        )
        - {name}
        for name, path in ((p.stem, p) for p in FOLDER.glob("*.py"))
    }


def _circle(graph: dict):
    """One import circle as a list of modules (first == last), or None."""
    done, trail = set(), []

    def visit(name):
        if name in trail:
            return trail[trail.index(name) :] + [name]
        if name in done:
            return None
        trail.append(name)
        for other in sorted(graph.get(name, ())):
            found = visit(other)
            if found:
                return found
        trail.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name)
        if found:
            return found
    return None


def test_the_graph_sees_the_imports():
    # A parser that found no edges would pass the circle test vacuously.
    graph = _import_graph()
    assert {"_group", "_collectives", "heap", "hybrid"} <= graph["fsdp2"]
    assert "_group" in graph["_collectives"]
    assert "fsdp2" in graph["__init__"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_odc_torch_modules_import_without_a_circle():
    circle = _circle(_import_graph())
    assert circle is None, "import circle in odc.torch: " + " -> ".join(circle)
