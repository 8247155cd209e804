"""Imports go one way: no cycle between bot's packages or between its modules, the pure parts
(matching, clusters) reach no store, GitHub, web or settings, and test files share data through
tests/samples.py instead of importing each other. Read from the source, so a change that breaks
a rule fails here before it makes the next change harder."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

BOT = ROOT / "bot"


def _module(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, prefix: str) -> set[str]:
    """Every module under ``prefix`` that ``path`` imports, at its top or inside a function (a
    lazy import is still a dependency)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == prefix or name.startswith(prefix + ".")}


def _graph() -> tuple[dict[str, set[str]], set[str], set[str]]:
    files = sorted(BOT.rglob("*.py"))
    modules = {_module(f) for f in files}
    packages = {_module(f) for f in files if f.name == "__init__.py"}
    graph = {_module(f): _imports(f, "bot") & modules for f in files}
    return graph, modules, packages


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package(module: str, packages: set[str]) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else module


def test_cycles_are_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_cycle_between_packages() -> None:
    graph, _, packages = _graph()
    between: dict[str, set[str]] = defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            a, b = _package(source, packages), _package(target, packages)
            if a != b and "bot" not in (a, b):
                between[a].add(b)
    assert _cycles(between) == []


def test_no_cycle_between_modules() -> None:
    graph, _, packages = _graph()
    # A package's __init__ re-exports its modules' names; importing those names is importing
    # the modules, which the edges to the modules themselves already say.
    modules = {m: {t for t in targets if t not in packages} for m, targets in graph.items()
               if m not in packages}
    assert _cycles(modules) == []


def test_the_pure_parts_reach_no_store_github_web_or_settings() -> None:
    graph, _, packages = _graph()
    banned = ("bot.db", "bot.github", "bot.web", "bot.jobs", "bot.features", "bot.settings",
              "bot.metrics")
    for source, targets in graph.items():
        if _package(source, packages) in ("bot.matching", "bot.clusters"):
            reached = sorted(t for t in targets if t.startswith(banned))
            assert not reached, f"{source} imports {reached}"


def test_test_files_do_not_import_each_other() -> None:
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        others = sorted(name for name in _imports(path, "tests")
                        if name.split(".")[-1].startswith("test_"))
        assert not others, f"{path.name} imports {others}: move what they share to samples.py"


def test_every_bench_script_imports() -> None:
    """mypy skips bench/ and most scripts are run by hand: a name removed from bot must not
    leave one that fails on its first line."""
    import importlib

    for path in sorted((ROOT / "bench").glob("*.py")):
        importlib.import_module(f"bench.{path.stem}")
