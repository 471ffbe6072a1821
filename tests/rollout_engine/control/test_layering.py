"""The control plane sits above the scheduler and the weights: ``scheduler/`` never imports
``control/``, ``weights/`` imports neither, and no import circle joins the three (module-level
imports, ``TYPE_CHECKING`` blocks included: what runs when a module is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import rollout_engine

ROOT = Path(rollout_engine.__file__).parent
PACKAGES = ("scheduler", "control", "weights")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules imported by statements that run at import time (not inside functions)."""
    found: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in _top_level_imports(ast.parse(path.read_text()))
                   if m in modules and m != name}
            for name, path in modules.items()}


def test_no_upward_imports():
    for name, imported in _graph().items():
        pkg = name.split(".")[1]
        banned = {"scheduler": ("control",), "weights": ("scheduler", "control")}.get(pkg, ())
        bad = sorted(m for m in imported if m.split(".")[1] in banned)
        assert not bad, f"{name} imports {bad}"


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep] if dep in path else [name, dep]
                raise AssertionError(f"import circle: {' -> '.join(circle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
