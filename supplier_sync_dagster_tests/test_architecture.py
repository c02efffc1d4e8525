"""The house's rules, read from the package's own source: no import cycles, no private name
borrowed across modules, imports at the top of a module (or deferred for a measured saving),
short functions, and ``core/`` free of Dagster. (Dagster's internals only behind
``dagster_instance/``: ``dagster_instance/test_dagster_internals.py``.)

Each rule is checked on the syntax tree of every module of ``supplier_sync_dagster``, so a
failure names the file and line to open; only the deferred imports' savings are measured by
running Python.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "supplier_sync_dagster"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE
MAX_FUNCTION_LINES = 120

# Imports inside a function, each kept because a process that never takes that path (the
# embedded defaults: SQLite, no Redis, no S3, no PostgreSQL) is spared the import: importer ->
# {deferred module: the least saving in seconds that
# test_each_deferred_import_saves_start_up_time asserts}.
DEFERRED_IMPORTS: dict[str, dict[str, float]] = {
    f"{PACKAGE}.core.leasing.claim_locks": {"redis": 0.02},
    f"{PACKAGE}.core.outbox.projections": {"psycopg": 0.03, "redis": 0.02},
    f"{PACKAGE}.core.store.db": {"pymysql": 0.008},
    f"{PACKAGE}.core.store.payloads": {"boto3": 0.03},
    f"{PACKAGE}.core.supplier.ratelimit": {"redis": 0.02},
    f"{PACKAGE}.core.supplier.governor": {"redis": 0.02},
    f"{PACKAGE}.defs.resources": {"dagster_aws": 0.15, f"{PACKAGE}.simulator": 0.015},
}


@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name, its file and its syntax tree."""

    name: str
    path: Path
    tree: ast.Module

    def where(self, node: ast.AST) -> str:
        """``file:line`` of a node, relative to the package's parent."""
        return f"{self.path.relative_to(PACKAGE_DIR.parent)}:{getattr(node, 'lineno', 0)}"


@cache
def modules() -> dict[str, Module]:
    """Every module of the package by dotted name (a package by its own name)."""
    found: dict[str, Module] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        found[name] = Module(name, path, ast.parse(path.read_text(), filename=str(path)))
    return found


def _imported(module: Module, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The package's modules that one import statement names."""
    known = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    base = node.module or ""
    if node.level:
        anchor = module.name.split(".")
        if module.path.name != "__init__.py":
            anchor.pop()
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in known:
            yield submodule
        elif base in known:
            yield base


def _imports(module: Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _imported(module, node):
                if target != module.name:
                    yield node, target


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_the_package_has_no_import_cycles() -> None:
    # Imports inside functions count: a late import that dodges a cycle is still one.
    edges: dict[str, set[str]] = {name: set() for name in modules()}
    for module in modules().values():
        for _, target in _imports(module):
            edges[module.name].add(target)
    cycles = _cycles(edges)
    assert not cycles, "\n".join(" <-> ".join(group) for group in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_borrows_another_modules_private_names() -> None:
    borrowed = []
    for module in modules().values():
        module_names: set[str] = set()
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                own_package = module.name if module.path.name == "__init__.py" else None
                for alias in node.names:
                    # A package may import its own private submodule; nothing else is lent.
                    private_submodule = node.module == (
                        own_package or module.name.rpartition(".")[0]
                    )
                    if _is_private(alias.name) and not private_submodule:
                        borrowed.append(f"{module.where(node)} imports {alias.name}")
                    if f"{node.module}.{alias.name}" in modules():
                        module_names.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE) and alias.asname:
                        module_names.add(alias.asname)
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_names
                and _is_private(node.attr)
            ):
                borrowed.append(f"{module.where(node)} uses {node.value.id}.{node.attr}")
    assert not borrowed, "\n".join(borrowed)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_imports_stand_at_the_top_of_their_module() -> None:
    inside = []
    for module in modules().values():
        for function in _functions(module.tree):
            for node in ast.walk(function):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or "."]
                )
                kept = DEFERRED_IMPORTS.get(module.name, {})
                for name in names:
                    if not any(name == k or name.startswith(k + ".") for k in kept):
                        inside.append(f"{module.where(node)} imports {name} in {function.name}()")
    assert not inside, "\n".join(sorted(set(inside)))


_SAVING = """
import importlib, json, sys, time
importlib.import_module(sys.argv[1])
loaded = sys.argv[2] in sys.modules
start = time.perf_counter()
importlib.import_module(sys.argv[2])
print(json.dumps({"loaded": loaded, "seconds": time.perf_counter() - start}))
"""


@pytest.mark.parametrize(
    ("importer", "deferred"),
    [(importer, deferred) for importer, kept in DEFERRED_IMPORTS.items() for deferred in kept],
)
def test_each_deferred_import_saves_start_up_time(importer: str, deferred: str) -> None:
    # In a fresh process: importing the module leaves the deferred one out, and importing that
    # one afterwards costs at least the saving stated (the least of three tries).
    runs = []
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _SAVING, importer, deferred],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        runs.append(json.loads(done.stdout))
    assert not any(run["loaded"] for run in runs), f"{importer} imports {deferred} itself"
    saving = min(run["seconds"] for run in runs)
    print(f"{importer}: deferring {deferred} saves {saving * 1000:.0f} ms")
    assert saving >= DEFERRED_IMPORTS[importer][deferred], f"{deferred} costs {saving:.3f} s"


def test_no_function_is_longer_than_the_limit() -> None:
    long = [
        f"{module.where(function)} {function.name}() is "
        f"{(function.end_lineno or function.lineno) - function.lineno + 1} lines"
        for module in modules().values()
        for function in _functions(module.tree)
        if (function.end_lineno or function.lineno) - function.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def _names_imported(module: Module) -> Iterator[tuple[ast.AST, str]]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node, node.module
            for alias in node.names:
                yield node, f"{node.module}.{alias.name}"


def test_core_never_imports_dagster() -> None:
    found = [
        f"{module.where(node)} imports {name}"
        for module in modules().values()
        if module.name.startswith(f"{PACKAGE}.core")
        for node, name in _names_imported(module)
        if name == "dagster" or name.startswith(("dagster.", "dagster_"))
    ]
    assert not found, "\n".join(found)
