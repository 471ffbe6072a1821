"""Which package may import which: the runtime sits above the step library and the control
plane above the scheduler and the weights. Every import counts, lazy ones included (the graph
of ``test_import_graph``, which also proves there is no circle)."""

from __future__ import annotations

from tests.rollout_engine.test_import_graph import import_graph

# package -> packages it must never import (all under rollout_engine)
NEVER = {
    "scheduler": ("control", "runtime"),
    "weights": ("scheduler", "control", "runtime"),
    "parallel": ("runtime",),
    "dp": ("runtime",),
}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for name, imported in graph.items():
        banned = NEVER.get(name.split(".")[1] if name.count(".") else "", ())
        out += [f"{name} -> {m}" for m in sorted(imported)
                if m.count(".") and m.split(".")[1] in banned]
    return out


def test_no_package_imports_one_it_sits_below() -> None:
    graph = import_graph()
    assert any(n.startswith("rollout_engine.runtime.") for n in graph)   # the walk saw them
    assert any(n.startswith("rollout_engine.control.") for n in graph)
    assert _upward(graph) == []


def test_an_upward_import_is_caught() -> None:
    graph = {"rollout_engine.scheduler.scheduler": {"rollout_engine.control.handlers"},
             "rollout_engine.control.handlers": {"rollout_engine.scheduler.scheduler"}}
    assert _upward(graph) == [
        "rollout_engine.scheduler.scheduler -> rollout_engine.control.handlers"]
