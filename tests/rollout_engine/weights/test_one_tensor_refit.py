"""A tensor refit is read and applied by one function, ``refit.refit_from_serialized``, in
every process that runs one: a plain engine, each tensor-parallel rank, an engine with a draft
model. The handlers only check their call and say where the tensors go."""

from __future__ import annotations

import ast
import pathlib

import rollout_engine

ROOT = pathlib.Path(rollout_engine.__file__).parent


def _callers(name: str) -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == name:
                    out.append(str(path.relative_to(ROOT)))
    return out


def test_only_the_one_refit_reads_a_tensor_payload() -> None:
    # and the one adapter load (its tensors go to the LoRA pool, not to parameters)
    assert _callers("read_refit_payload") == ["control/lora_control.py", "weights/refit.py"]


def test_every_tensor_refit_handler_goes_through_it() -> None:
    assert sorted(set(_callers("refit_from_serialized"))) == [
        "control/rl_control.py", "runtime/tp_worker.py"]
    # the draft engine's handler is rank 0's, with another destination
    text = (ROOT / "control" / "draft_refit.py").read_text()
    assert "def rpc_update_weights_from_tensor" not in text
    assert "def _tensor_destination" in text
