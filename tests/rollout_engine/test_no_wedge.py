"""The frontend never wedges: finalizers only record, sends never pickle under a lock a
finalizer could want, and an Engine collected without a shutdown still stops its scheduler."""

from __future__ import annotations

import ast
import gc
import pathlib
import threading
from typing import Any

import psutil
import pytest

import rollout_engine
from rollout_engine.protocol.messages import AbortReq

ROOTS = [pathlib.Path(rollout_engine.__file__).parent,
         pathlib.Path(rollout_engine.__file__).parent.parent / "trainer_bridge",
         pathlib.Path(rollout_engine.__file__).parent.parent / "kernels"]

# What a finalizer may call: recording into a container, reading attributes. Anything else
# (a send, a join, a lock, a close, a log line) belongs in ordinary code that drains the record.
RECORDING_CALLS = {"append", "appendleft", "pop", "popleft", "add", "discard", "getattr",
                   "isinstance", "_on_drop"}


def _called_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return ast.dump(f)


def _problems(body: list[ast.stmt], functions: dict[str, ast.FunctionDef],
              seen: set[str]) -> list[str]:
    found = []
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, (ast.With, ast.AsyncWith, ast.Await, ast.Yield, ast.Raise)):
            found.append(f"{type(node).__name__} at line {node.lineno}")
        elif isinstance(node, ast.Call):
            name = _called_name(node)
            if name in functions and name not in seen:   # a module function: check its body
                seen.add(name)
                found += _problems(functions[name].body, functions, seen)
            elif name not in RECORDING_CALLS:
                found.append(f"calls {name}() at line {node.lineno}")
    return found


def _finalizers() -> list[tuple[str, list[ast.stmt], dict[str, ast.FunctionDef]]]:
    """(where, body, the module's functions) for every ``__del__`` and weakref callback."""
    out = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name == "__del__":
                    out.append((f"{path.name}:{node.lineno} __del__", node.body, functions))
                elif (isinstance(node, ast.Call) and _called_name(node) in {"ref", "finalize"}
                      and isinstance(node.func, ast.Attribute)
                      and getattr(node.func.value, "id", None) == "weakref"):
                    for cb in node.args[1:]:
                        body = [ast.Expr(cb.body)] if isinstance(cb, ast.Lambda) else [ast.Expr(cb)]
                        out.append((f"{path.name}:{node.lineno} weakref callback", body,
                                    functions))
    return out


def test_no_finalizer_performs_io_or_takes_a_lock() -> None:
    finalizers = _finalizers()
    where = sorted(w.split(":")[0] for w, _, _ in finalizers)
    # the audit must see the project's finalizers, or it proves nothing
    assert {"request_state.py", "engine.py", "weight_packs.py"} <= set(where), where
    bad = {w: p for w, body, fns in finalizers if (p := _problems(body, fns, set()))}
    assert not bad, f"finalizers that do more than record: {bad}"


def test_the_audit_catches_a_finalizer_that_sends() -> None:
    tree = ast.parse("class S:\n    def __del__(self):\n        self.chan.send(1)\n")
    (cls,) = tree.body
    assert _problems(cls.body[0].body, {}, set()) == ["calls send() at line 3"]


class _DropsWhilePickled:
    """Pickles as a plain string; on the way it drops the last reference to ``box``'s items,
    so their finalizers run inside the pickling of another message (what the collector does
    at any allocation)."""

    def __init__(self, box: list[Any]) -> None:
        self.box = box

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        self.box.clear()
        return (str, ("no-such-request",))


@pytest.fixture
def process_engine(qwen2_path: str):
    from rollout_engine import Engine

    engine = Engine(model_path=qwen2_path, dtype="float32", device="cpu",
                    scheduler_mode="process")
    yield engine
    proc = psutil.Process(engine.tm.host.pid)
    if wedged := getattr(engine, "_wedged", False):
        proc.kill()   # the frontend's send lock is held for good: a shutdown would hang too
    else:
        engine.shutdown()
    proc.wait(10)
    assert not wedged


def test_a_stream_dropped_inside_a_send_neither_deadlocks_nor_keeps_running(
        process_engine: Any) -> None:
    tm = process_engine.tm
    (st,), _ = process_engine._submit(None, {"max_new_tokens": 2000, "temperature": 1.0,
                                             "ignore_eos": True},
                                      [5, 6, 7, 8], False, 0, -1, True, "dropped", None)
    box = [tm.iter_chunks(st)]
    sender = threading.Thread(
        target=tm.host.chan.send, args=(AbortReq(rid=_DropsWhilePickled(box)),), daemon=True)
    sender.start()
    sender.join(10)
    process_engine._wedged = sender.is_alive()
    assert not sender.is_alive(), "the send deadlocked on a finalizer that sent"
    out = tm.wait(st, timeout=30)   # the dropped stream's abort reached the scheduler
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 2000
    process_engine.check_integrity()


def test_an_engine_collected_without_shutdown_stops_its_scheduler(qwen2_path: str) -> None:
    from rollout_engine import Engine

    engine = Engine(model_path=qwen2_path, dtype="float32", device="cpu",
                    scheduler_mode="process")
    child = psutil.Process(engine.tm.host.pid)
    receiver = engine.tm.receiver
    del engine
    gc.collect()
    child.wait(15)      # raises psutil.TimeoutExpired if the scheduler outlives its Engine
    receiver.join(15)
    assert not receiver.is_alive()
