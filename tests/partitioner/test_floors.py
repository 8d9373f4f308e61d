"""The floors of ``partitioner``, read from the source with ``ast``: the root (vocabulary and pricing)
imports nothing from ``search`` (the planners) or ``show`` (output), no module imports the TensorFlow side
at import time, and the modules import one another without a cycle (docs/architecture.md, "Floors")."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import partitioner

ROOT = Path(partitioner.__file__).parent
UPPER_FLOORS = ("partitioner.search", "partitioner.show")
# Front doors: they gather the floors for users (``import partitioner as pt``, the ``partitioner`` command)
# and may import upward, and TensorFlow's side inside the functions that profile or run a model.
FRONT_DOORS = ("partitioner", "partitioner.cli")
TENSORFLOW_SIDE = ("profiles", "runtime", "tensorflow", "keras")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """Every import of ``module`` as (imported module, line, at import time), ``from a import b`` as ``a.b``
    where ``b`` is a module; imports inside functions or under ``if TYPE_CHECKING:`` do not run at import time."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            type_checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            runs = at_import and not in_function and not type_checking
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, runs) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    name = f"{base}.{alias.name}"
                    found.append((name if name in MODULES else base, child.lineno, runs))
            visit(child, runs)

    visit(ast.parse(path.read_text()), True)
    return found


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT.parent)}:{line}"


def test_floors_read_real_imports():
    """The reader sees the imports the checks below judge (a check that reads nothing cannot fail)."""
    assert {"partitioner.cost", "partitioner.search", "partitioner.show", "partitioner.cli"} <= set(MODULES)
    assert ("partitioner.cluster", True) in {(name, runs) for name, _, runs in _imports("partitioner.cost")}
    assert any(name == "runtime" and not runs for name, _, runs in _imports("partitioner"))


def test_floors_root_imports_no_planner_and_no_output():
    offending = [
        f"{_where(module, line)}: {module} imports {name}"
        for module in MODULES
        if not _within(module, UPPER_FLOORS) and module not in FRONT_DOORS
        for name, line, _ in _imports(module)
        if _within(name, UPPER_FLOORS)
    ]
    assert not offending, "the root floor imports upward: " + "; ".join(offending)


def test_floors_search_imports_no_output():
    offending = [
        f"{_where(module, line)}: {module} imports {name}"
        for module in MODULES
        if _within(module, ("partitioner.search",))
        for name, line, _ in _imports(module)
        if _within(name, ("partitioner.show",))
    ]
    assert not offending, "a planner imports the output floor: " + "; ".join(offending)


def test_floors_no_tensorflow_side_at_import_time():
    """Nothing in partitioner imports profiles, runtime, TensorFlow or Keras when imported; only the front
    doors import them, inside the functions that profile or run a model."""
    offending = [
        f"{_where(module, line)}: {module} imports {name}" + ("" if runs else " (inside a function)")
        for module in MODULES
        for name, line, runs in _imports(module)
        if _within(name, TENSORFLOW_SIDE) and (runs or module not in FRONT_DOORS)
    ]
    assert not offending, "partitioner reaches the TensorFlow side: " + "; ".join(offending)


def test_floors_no_import_cycle():
    """No cycle among the modules of partitioner, counting the imports inside functions too (a lazy import
    that closes a cycle only hides it); the package's own ``__init__`` is not an edge of its submodules."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    lines: dict[tuple[str, str], int] = {}
    for module in MODULES:
        for name, line, _ in _imports(module):
            if name in MODULES and name != module:
                graph.add_edge(module, name)
                lines.setdefault((module, name), line)
    cycles = sorted(nx.simple_cycles(graph), key=len)
    described = [
        " -> ".join(f"{a} ({_where(a, lines[a, b])})" for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True))
        + f" -> {cycle[0]}"
        for cycle in cycles[:5]
    ]
    assert not cycles, f"{len(cycles)} import cycle(s) in partitioner: " + "; ".join(described)
