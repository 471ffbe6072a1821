"""Every state change of a request happens in ``scheduler/lifecycle.py``: no other module of the
package sets a ``Req``'s state, adds to or removes from the in-flight table, or puts requests on
or takes them off the waiting queue or the running batch (the scheduling policy only reorders
them and picks a victim, which it hands to ``retract``)."""

from __future__ import annotations

import ast
import pathlib

import rollout_engine

ROOT = pathlib.Path(rollout_engine.__file__).parent
OWNERS = {"scheduler/lifecycle.py", "scheduler/request.py"}   # request.py: Req's constructor
MUTATORS = {"waiting": {"append", "appendleft", "extend", "remove", "popleft", "clear"},
            "running": {"append", "extend", "remove", "clear", "insert"},
            "inflight": {"add", "remove"}}


def _changes(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and target.attr == "state"
                        and "ReqState" in ast.unparse(node.value)):
                    found.append(ast.unparse(node))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.attr in MUTATORS.get(node.func.value.attr, ())):
            found.append(ast.unparse(node.func))
    return found


def test_only_the_lifecycle_changes_a_request_state() -> None:
    outside = {str(p.relative_to(ROOT)): _changes(ast.parse(p.read_text()))
               for p in ROOT.rglob("*.py") if str(p.relative_to(ROOT)) not in OWNERS}
    assert {k: v for k, v in outside.items() if v} == {}
    assert _changes(ast.parse((ROOT / "scheduler" / "lifecycle.py").read_text()))


def test_a_change_outside_is_caught() -> None:
    src = "req.state = ReqState.DECODE\nself.running.append(req)\ns.inflight.add(req)\n"
    assert _changes(ast.parse(src)) == [
        "req.state = ReqState.DECODE", "self.running.append", "s.inflight.add"]
