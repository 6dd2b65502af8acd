"""The code's floor plan stays true: the node's map names every module, wings import only downwards,
nothing imports in a circle, and the shared library imports no service."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

import services.node

REPO: Final = Path(__file__).resolve().parent.parent
NODE: Final = REPO / "services" / "node"
LEAVES: Final = frozenset({"settings", "metrics"})
"""Node modules every wing may import; they import nothing of the node."""
MAX_ROOT_MODULES: Final = 8
MAX_MODULE_LINES: Final = 700
"""No module of services/, libs/ or the CLI grows past this: split it by concept first."""
HEADING: Final = re.compile(r"^(root|[a-z_]+(?:/[a-z_]+)*/) — ", re.MULTILINE)
ENTRY: Final = re.compile(r"^    ``([a-z_.]+)``", re.MULTILINE)


def _map() -> list[tuple[str, list[str]]]:
    """The map's wings in order, top first, each with the modules it names (dotted, below ``services.node``)."""
    doc = services.node.__doc__ or ""
    marks = list(HEADING.finditer(doc))
    wings = []
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(doc)
        name = "" if mark.group(1) == "root" else mark.group(1).rstrip("/").replace("/", ".")
        wings.append((name, ENTRY.findall(doc, mark.end(), end)))
    return wings


def _node_modules() -> dict[str, str]:
    """Every module of the node, dotted below ``services.node``, with its wing (its package, ``""`` at the root)."""
    found = {}
    for path in NODE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        dotted = ".".join(path.relative_to(NODE).with_suffix("").parts)
        found[dotted] = dotted.rpartition(".")[0]
    return found


def _imports(path: Path, *, runtime_only: bool = False) -> Iterator[str]:
    """The absolute module names a file imports (every import, or only those run at import time)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = list(tree.body) if runtime_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "libs":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _project_files() -> list[Path]:
    return [p for top in ("services", "libs", "meshnet") for p in (REPO / top).rglob("*.py")]


def test_the_map_names_every_module_of_the_node_under_its_own_wing() -> None:
    modules = _node_modules()
    named = {module: wing for wing, entries in _map() for module in entries}
    assert set(named) == set(modules), (
        f"not on the map: {sorted(set(modules) - set(named))}; on the map but missing: "
        f"{sorted(set(named) - set(modules))}")
    misplaced = {m: (named[m], w) for m, w in modules.items() if named[m] != w}
    assert not misplaced, f"named under another wing (map, real): {misplaced}"


def test_the_node_root_holds_few_modules() -> None:
    root = [m for m, wing in _node_modules().items() if wing == ""]
    assert len(root) <= MAX_ROOT_MODULES, root


def test_each_wing_imports_only_the_wings_below_it_and_the_leaves() -> None:
    rank = {wing: i for i, (wing, _) in enumerate(_map())}
    modules = _node_modules()
    upward = []
    for module, wing in modules.items():
        for target in set(_imports(NODE / (module.replace(".", "/") + ".py"))):
            if not target.startswith("services.node."):
                continue
            name = target.removeprefix("services.node.")
            if name not in modules:
                continue  # a package, or a name imported from a module (counted by the module itself)
            if module in LEAVES:
                upward.append(f"{module} (a leaf) imports {name}")
            elif name in LEAVES or modules[name] == wing:
                continue
            elif rank[modules[name]] < rank[wing]:
                upward.append(f"{module} imports {name}, a wing above it")
    assert not upward, upward


def test_nothing_in_libs_imports_a_service_or_the_cli() -> None:
    bad = [f"{path.relative_to(REPO)} imports {target}" for path in (REPO / "libs").rglob("*.py")
           for target in _imports(path) if target.split(".")[0] in {"services", "meshnet", "benchmarks", "tests"}]
    assert not bad, bad


def test_no_service_imports_another() -> None:
    bad = []
    for path in (REPO / "services").rglob("*.py"):
        own = path.relative_to(REPO / "services").parts[0]
        for target in _imports(path):
            parts = target.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != own:
                bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, bad


def test_no_import_cycle_in_services_libs_or_the_cli() -> None:
    files = {_module_of(p): p for p in _project_files()}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for target in _imports(path, runtime_only=True):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        seen[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if target.startswith(module + "."):
                continue  # a package's __init__ importing its own modules is no cycle
            if seen.get(target) == 1 and not module.startswith(target + "."):
                pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(target):] + [target])}")
            if target not in seen:
                visit(target)
        stack.pop()
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module)


def test_no_module_grows_past_700_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _project_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"over {MAX_MODULE_LINES} lines: {long}"
