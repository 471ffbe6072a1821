"""No two modules of the package import each other, directly or round a circle, counting the
imports inside functions (a lazy import that breaks a circle at load time still ties the two
modules together). Imports under ``if TYPE_CHECKING:`` are annotations only and do not count."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable

import rollout_engine

PACKAGE = "rollout_engine"
ROOT = pathlib.Path(rollout_engine.__file__).parent.parent


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, tree: ast.AST, is_package: bool, modules: Iterable[str]) -> set[str]:
    """The package's modules that module ``name`` imports (the longest known prefix of each)."""
    known = set(modules)

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                    and child.test.id == "TYPE_CHECKING"):
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[:len(here) - (child.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in child.names]
                # `from pkg import submodule` imports the submodule; `from mod import name`, mod
                targets = subs if any(t in known for t in subs) else [base]
            for target in targets:
                if target.startswith(PACKAGE) and (r := resolve(target)) and r != name:
                    found.add(r)
            visit(child)

    visit(tree)
    return found


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, ast.parse(path.read_text()), path.name == "__init__.py",
                           modules)
            for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_round_a_circle() -> None:
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300   # the walk saw the package
    assert circles(graph) == []


def test_a_lazy_import_that_closes_a_circle_is_caught(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from rollout_engine.a import low\n")
    (pkg / "a" / "low.py").write_text("import os\n")
    (pkg / "b.py").write_text("from rollout_engine.a.low import os\n")
    (pkg / "c.py").write_text("def f():\n    from rollout_engine.b import os\n")
    assert circles(import_graph(tmp_path)) == []
    (pkg / "a" / "low.py").write_text("def g():\n    from rollout_engine import c\n")
    (pkg / "b.py").write_text("from rollout_engine.a.low import g\n")
    (pkg / "c.py").write_text("def f():\n    from rollout_engine.b import g\n")
    assert circles(import_graph(tmp_path)) == [
        ["rollout_engine.a.low", "rollout_engine.b", "rollout_engine.c"]]
