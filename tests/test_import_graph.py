"""No import cycle inside the package (#25, #31).

Every module of ``reliable_sub`` is parsed with :mod:`ast` (never imported), and an edge drawn
from it to each ``reliable_sub`` module it imports -- at the top, inside functions, and under
``if TYPE_CHECKING:`` alike, since a cycle a type checker needs is still two modules that cannot
be understood apart. ``from package import name`` counts as an import of ``package.name`` when
that is a module, else of ``package``; importing ``a.b.c`` also runs the packages ``a.b`` and
``a`` first, so those count too (except a module's own enclosing packages, which are always
initialised before it). A cycle found fails the test, named module by module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "reliable_sub"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a (maybe relative) ``from`` target, seen from ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _imports(module: str, path: Path, known: set[str]) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            targets = [source]
            targets += [f"{source}.{alias.name}" for alias in node.names
                        if f"{source}.{alias.name}" in known]
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            # the packages above the target run first, except those that enclose this module
            parts = target.split(".")
            for depth in range(2, len(parts) + 1):
                name = ".".join(parts[:depth])
                if name in known and name != module and not module.startswith(name + "."):
                    yield name


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: set(_imports(name, path, known)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle inside ``component``, as a -> b -> ... -> a, for the failure message."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if target not in previous:
                previous[target] = node
                queue.append(target)
    return component


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(_path_through(graph, c)) + f"   (modules: {', '.join(c)})" for c in found)


def test_the_check_sees_a_cycle_under_type_checking_and_relative_imports() -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert _resolve("reliable_sub._runtime.lease", False, 2, "dedup") == "reliable_sub.dedup"
    assert _resolve("reliable_sub._runtime", True, 1, "lease") == "reliable_sub._runtime.lease"
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
    module = ast.parse(source)
    guarded = [n for n in ast.walk(module) if isinstance(n, ast.ImportFrom) and n.level == 1]
    assert guarded, "an import under TYPE_CHECKING is found by the walk"


def test_no_module_of_the_delivery_path_is_over_400_lines() -> None:
    # #25: the runtime is split by job; a module that grows past this is doing two
    sizes = {path.name: len(path.read_text().splitlines())
             for path in (ROOT / "_runtime").glob("*.py")}
    assert sizes and max(sizes.values()) <= 400, {n: s for n, s in sizes.items() if s > 400}
