"""One weight generation (`models/weight_writes.py`): every parameter write in the package sits
inside ``writing()``, every writer moves the generation, and what is keyed by it (the packed
copies, the scheduler's KV namespace) follows."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import rollout_engine
from rollout_engine.memory.memory_saver import create_memory_saver
from rollout_engine.models import weight_writes
from rollout_engine.models.llama import ModelArch
from rollout_engine.models.registry import build_model
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.weights import checker
from rollout_engine.weights.loader import load_weights, read_hf_config
from rollout_engine.weights.shadow import ShadowWeights
from tests.rollout_engine.test_weight_packs import NoKV

ROOT = pathlib.Path(rollout_engine.__file__).parent
NAME = "model.layers.0.mlp.down_proj.weight"


def _is_writing(item: ast.withitem) -> bool:
    f = item.context_expr.func if isinstance(item.context_expr, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "writing" and \
        isinstance(f.value, ast.Name) and f.value.id == "weight_writes"


def _parameter_writes(node: ast.AST) -> list[int]:
    """Lines of ``x.data = ...`` (new storage) and ``x.data.copy_(...)`` / ``x.data[...] = ...``
    (bytes into a parameter) under ``node`` that no ``with weight_writes.writing()`` encloses."""
    out: list[int] = []

    def visit(n: ast.AST, guarded: bool) -> None:
        if isinstance(n, ast.With) and any(_is_writing(i) for i in n.items):
            guarded = True
        if not guarded:
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    base = t.value if isinstance(t, ast.Subscript) else t
                    if isinstance(base, ast.Attribute) and base.attr == "data":
                        out.append(n.lineno)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr == "copy_" and isinstance(n.func.value, ast.Attribute) and \
                    n.func.value.attr == "data":
                out.append(n.lineno)
        for child in ast.iter_child_nodes(n):
            visit(child, guarded)

    visit(node, False)
    return out


def test_every_parameter_write_in_the_package_moves_the_generation() -> None:
    unguarded, seen = [], 0
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        seen += sum(isinstance(n, ast.With) and any(_is_writing(i) for i in n.items)
                    for n in ast.walk(tree))
        unguarded += [f"{path.relative_to(ROOT)}:{line}" for line in _parameter_writes(tree)]
    assert seen >= 6                      # loader, disk reader, shadow, saver x2, checker, ...
    assert unguarded == []


def test_the_audit_catches_an_unguarded_write() -> None:
    src = ("def f(p, q, s):\n"
           "    p.data = s\n"
           "    q.data.copy_(s)\n"
           "    with weight_writes.writing():\n"
           "        p.data = s\n")
    assert _parameter_writes(ast.parse(src)) == [2, 3]


@pytest.fixture()
def model():
    from rollout_engine.testing.tiny_model import tiny_model_path

    m = build_model(ModelArch.from_hf_config(read_hf_config(str(tiny_model_path("qwen2")))))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=torch.Generator().manual_seed(0))
    return m


def _load(model) -> None:
    w = model.weight_map()[NAME][0]
    load_weights(model, [(NAME, torch.ones(w.shape))])


def _shadow_swap(model) -> None:
    w = model.weight_map()[NAME][0]
    shadow = ShadowWeights(model)
    plan = shadow.plan([NAME], [w.dtype], [tuple(w.shape)])
    plan.views[0].fill_(2.0)
    shadow.commit(plan)


def _sleep_and_wake(model) -> None:
    saver = create_memory_saver(model, NoKV(), True, torch.device("cpu"))
    saver.release(["weights"])
    saver.resume(["weights"])


@pytest.mark.parametrize("write", [_load, _shadow_swap, _sleep_and_wake,
                                   lambda m: checker.reset(m)],
                         ids=["load", "shadow", "sleep_wake", "checker_reset"])
def test_each_writer_moves_the_generation(model, write) -> None:
    before = weight_writes.generation()
    write(model)
    assert weight_writes.generation() > before


def test_a_load_that_fails_midway_still_moves_it(model) -> None:
    w = model.weight_map()[NAME][0]
    before = weight_writes.generation()
    with pytest.raises(RuntimeError, match="midway"):
        with weight_writes.writing():
            w.data[0].fill_(3.0)
            raise RuntimeError("midway")
    assert weight_writes.generation() > before


def test_the_kv_namespace_follows_every_load_and_only_loads(model) -> None:
    state = WeightState("v0")
    _load(model)
    g1 = state.loaded([NAME], None)
    assert g1 == weight_writes.generation()
    _sleep_and_wake(model)       # a wake from a backup: same values, KV still valid
    assert state.generation == g1
    _load(model)
    g2 = state.partly_written([NAME])
    assert g2 == weight_writes.generation() > g1
    assert state.loaded([], None) > g2    # a load that wrote nothing still counts as a change


def test_listeners_run_on_every_move() -> None:
    calls: list[int] = []
    weight_writes.on_change(lambda: calls.append(weight_writes.generation()))
    try:
        with weight_writes.writing():
            pass
    finally:
        weight_writes._listeners.pop()
    assert len(calls) == 2 and calls[1] > calls[0]
