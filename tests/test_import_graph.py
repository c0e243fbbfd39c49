"""graphrt's imports point one way: no module imports, even lazily inside a function, a module
that imports it back (docs/ARCHITECTURE.md: the core never imports a feature's internals)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graphrt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """Module -> the graphrt modules it imports anywhere in its code (``from pkg import mod`` counts as mod)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "graphrt":
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = targets - {name}
    return graph


def test_no_import_cycles():
    try:
        tuple(TopologicalSorter(import_graph()).static_order())
    except CycleError as error:
        raise AssertionError(f"import cycle: {' -> '.join(error.args[1])}") from None


def test_the_check_detects_a_cycle():
    graph = import_graph()
    graph["graphrt.staging"] = graph["graphrt.staging"] | {"graphrt.pools.buffers"}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError:
        return
    raise AssertionError("staging <-> pools.buffers should be a cycle")


def test_importing_graphrt_and_its_hugging_face_front_does_not_import_transformers():
    """transformers is a test and bench dependency: graphrt.hf imports its transformers-backed
    modules only inside the functions that need them."""
    code = "import sys, graphrt, graphrt.hf; print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


# The layers of a key's machinery, bottom first: a module of one imports none of a layer above it (issue 49,
# item 10). A capture-time check that needs capture and the guards lives beside capture, above them all.
LAYERS = ("graphrt.backends", "graphrt.layout", "graphrt.guards")


def upward_imports(graph: dict) -> list:
    """``(module, imported)`` where a module of one layer imports one of a layer above it."""
    def layer(name: str) -> int:
        return next((index for index, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")), -1)

    return sorted((name, target) for name, targets in graph.items() for target in targets
                  if layer(name) >= 0 and layer(target) > layer(name))


def test_backends_layout_and_guards_stand_one_above_another():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    graph = import_graph()
    graph["graphrt.backends.base"] = graph["graphrt.backends.base"] | {"graphrt.guards.epoch"}
    assert ("graphrt.backends.base", "graphrt.guards.epoch") in upward_imports(graph)
