"""The runtime sits above the step library: ``scheduler/``, ``parallel/`` and ``dp/`` never
import ``runtime/``, and ``runtime/``'s modules import each other without a circle (so no
circle runs through the runtime and those packages). Every import statement counts, those
inside functions included: a deferred import still closes a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import rollout_engine

ROOT = Path(rollout_engine.__file__).parent
PACKAGES = ("runtime", "scheduler", "parallel", "dp")
BELOW = ("scheduler", "parallel", "dp")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in _imports(ast.parse(path.read_text()))
                   if m in modules and m != name}
            for name, path in modules.items()}


def test_the_step_library_never_imports_the_runtime():
    graph = _graph()
    assert any(name.startswith("rollout_engine.runtime.") for name in graph)   # it looked
    for name, imported in graph.items():
        if name.split(".")[1] in BELOW:
            bad = sorted(m for m in imported if m.split(".")[1] == "runtime")
            assert not bad, f"{name} imports {bad}"


def test_no_import_circle_in_the_runtime():
    graph = {name: {m for m in imported if m.split(".")[1] == "runtime"}
             for name, imported in _graph().items() if name.split(".")[1] == "runtime"}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep]
                raise AssertionError(f"import circle: {' -> '.join(circle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
