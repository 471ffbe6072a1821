"""Refitting a STANDALONE draft with the target, by every transport (disk, tensor handles, a
torch.distributed broadcast), and the errors that must change nothing.

The refit's target is W2 and its draft is W2's own weights: a fresh engine started so drafts for
itself, every greedy proposal holds, so equal outputs *and* equal acceptance counts show that
both models (and the draft's KV after the radix cache) carry the new weights. Before the refit
the engine runs W1 with a draft D1 of the same shape but other weights (most proposals fail).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch

from rollout_engine.control.draft_refit import split_for_draft
from rollout_engine.speculative.selector import check_target_only, resolve_selector
from rollout_engine.testing.tiny_model import tiny_model_path
from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import repeated_prompts, run

PROMPTS = repeated_prompts(3, seed=21)
PARAMS = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
          {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True,
           "sampling_seed": 5},
          {"temperature": 0, "max_new_tokens": 17, "ignore_eos": True}]
PROBE = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return {"w1": str(tiny_model_path("qwen2")), "w2": str(tiny_model_path("qwen2", seed=1)),
            "d1": str(tiny_model_path("qwen2", seed=2))}


def standalone(draft: str, **flags: Any) -> dict[str, Any]:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
            "speculative_num_steps": 3, "debug_integrity": True, **flags}


def generate(engine: Any) -> list[dict[str, Any]]:
    return run(engine, PROMPTS, PARAMS, return_logprob=True)


def summary(outs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must match a fresh engine: tokens and the acceptance counts (greedy rows)."""
    return [(o["output_ids"], o["meta_info"]["spec_accept_token_num"],
             o["meta_info"]["spec_draft_token_num"]) for o in outs]


def assert_equal(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert summary(got) == summary(ref)
    for x, y in zip(got, ref, strict=True):
        lx = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
        ly = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4


@pytest.fixture(scope="module")
def reference(paths: dict[str, str]) -> list[dict[str, Any]]:
    """A fresh engine on W2 drafting with W2."""
    for eng in thread_engine(paths["w2"], **standalone(paths["w2"])):
        outs = generate(eng)
    greedy = [outs[0], outs[2]]
    assert all(o["meta_info"]["spec_accept_token_num"] == o["meta_info"]["spec_draft_token_num"]
               > 0 for o in greedy)
    return outs


@pytest.fixture(scope="module")
def shared(paths: dict[str, str]) -> Any:
    yield from thread_engine(paths["w1"], **standalone(paths["d1"]))


@pytest.fixture
def engine(shared: Any, paths: dict[str, str]) -> Any:
    """The shared engine back on W1 + D1 (a disk refit of both)."""
    ok, msg = shared.update_weights_from_disk(paths["w1"], draft_model_path=paths["d1"])
    assert ok, msg
    return shared


def tensors(path: str, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    return [(prefix + n, t) for n, t in iter_safetensors(path)]


def both(path: str) -> list[tuple[str, torch.Tensor]]:
    return tensors(path) + tensors(path, "draft.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast(engine: Any, named: list[tuple[str, torch.Tensor]], **kw: Any) -> tuple[bool, str]:
    """Play the trainer: rank 0 of a gloo group broadcasting ``named`` to the engine."""
    from rollout_engine.protocol.bucket import dtype_to_str
    from rollout_engine.protocol.weight_broadcast import join_update_group

    port, box = free_port(), {}
    t = threading.Thread(target=lambda: box.update(init=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="draft_g", backend="gloo")))
    t.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, "draft_g", "gloo", 60)
    t.join()
    assert box["init"][0], box
    t = threading.Thread(target=lambda: box.update(upd=engine.update_weights_from_distributed(
        [n for n, _ in named], [dtype_to_str(x.dtype) for _, x in named],
        [list(x.shape) for _, x in named], group_name="draft_g", **kw)))
    t.start()
    for _, x in named:
        pg.broadcast(x.contiguous()).wait()
    t.join()
    assert engine.destroy_weights_update_group("draft_g")[0]
    return box["upd"]


@pytest.mark.parametrize("transport", ["disk", "tensor", "distributed"])
def test_refit_of_target_and_draft_equals_a_fresh_engine(transport: str, engine: Any,
                                                        paths: dict[str, str],
                                                        reference: list[dict[str, Any]]) -> None:
    before = generate(engine)          # W1 / D1 KV now in the radix cache
    assert summary(before) != summary(reference)
    if transport == "disk":
        ok, msg = engine.update_weights_from_disk(paths["w2"], draft_model_path=paths["w2"])
    elif transport == "tensor":
        ok, msg = engine.update_weights_from_tensor(both(paths["w2"]))
    else:
        ok, msg = broadcast(engine, both(paths["w2"]))
    assert ok, msg
    got = generate(engine)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in got)   # old KV never matched
    assert_equal(got, reference)
    again = generate(engine)           # radix hits on the new KV, the draft's included
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert_equal(again, reference)
    draft_probe = torch.tensor(engine.get_weights_by_name("draft." + PROBE, truncate_size=2))
    assert torch.equal(draft_probe, dict(tensors(paths["w2"]))[PROBE][:2])


def test_selectors_address_one_model(engine: Any, paths: dict[str, str],
                                     reference: list[dict[str, Any]]) -> None:
    """SGLang's selector: a plain update (or selector 'target') leaves the draft as it was; then
    selector 'draft' refits the draft alone, by unprefixed names, and by broadcast."""
    ok, msg = engine.update_weights_from_tensor(tensors(paths["w2"]), selector="target")
    assert ok, msg
    target_only = generate(engine)
    assert [o["output_ids"] for o in target_only] == [o["output_ids"] for o in reference]
    assert summary(target_only) != summary(reference)    # D1 still drafts
    ok, msg = broadcast(engine, tensors(paths["w2"]), selector="draft")
    assert ok, msg
    assert_equal(generate(engine), reference)
    ok, msg = engine.update_weights_from_disk(paths["d1"], selector="draft")
    assert ok, msg
    assert summary(generate(engine)) == summary(target_only)   # back to D1 drafting for W2


def test_a_bad_draft_update_changes_nothing(engine: Any, paths: dict[str, str]) -> None:
    base = generate(engine)
    target_w = engine.get_weights_by_name(PROBE, truncate_size=2)
    draft_w = engine.get_weights_by_name("draft." + PROBE, truncate_size=2)
    w2 = tensors(paths["w2"])
    small = str(tiny_model_path("qwen2", seed=2, hidden_size=32, num_heads=2, num_kv_heads=1))
    wrong_shape = [("draft." + PROBE, torch.zeros(3, 3))]
    bad = [
        (lambda: engine.update_weights_from_tensor(w2 + [("draft.model.nope.weight",
                                                          torch.zeros(2))]),
         "draft: unknown weight name 'model.nope.weight'"),
        (lambda: engine.update_weights_from_tensor(w2 + wrong_shape), "draft: weight"),
        (lambda: engine.update_weights_from_tensor(both(paths["w2"]), selector="target"),
         "selector is 'target'"),
        (lambda: engine.update_weights_from_tensor(both(paths["w2"]), disable_draft_model=True),
         "disable_draft_model is true"),
        (lambda: engine.update_weights_from_tensor(w2, selector="draft",
                                                   disable_draft_model=True),
         "mutually exclusive"),
        (lambda: engine.update_weights_from_tensor(w2, selector="both"), "selector: must be"),
        (lambda: engine.update_weights_from_disk(paths["w2"], draft_model_path=small),
         "draft_model_path: weight"),
        (lambda: engine.update_weights_from_disk(paths["w2"], selector="draft",
                                                 draft_model_path=paths["w2"]),
         "draft_model_path: only with selector 'all'"),
        (lambda: broadcast(engine, w2 + wrong_shape), "draft: weight"),
    ]
    for call, message in bad:
        ok, msg = call()
        assert not ok
        assert message in msg, msg
    assert engine.get_weights_by_name(PROBE, truncate_size=2) == target_w
    assert engine.get_weights_by_name("draft." + PROBE, truncate_size=2) == draft_w
    assert_equal(generate(engine), base)   # (a radix hit now: logprobs equal within 1e-4)


def test_sleep_wake_then_refit_with_a_draft(engine: Any, paths: dict[str, str],
                                            reference: list[dict[str, Any]]) -> None:
    """No CPU backup: after the wake the target refuses to generate until refit; one tensor
    update refits both, and the outputs equal the fresh engine's."""
    engine.release_memory_occupation()
    assert engine.resume_memory_occupation()["weights_stale"]
    ok, msg = engine.update_weights_from_tensor(both(paths["w2"]))
    assert ok, msg
    assert_equal(generate(engine), reference)


def test_selector_rules() -> None:
    assert resolve_selector(None) == "all"
    assert resolve_selector("draft") == "draft"
    assert resolve_selector(None, disable_draft_model=True) == "target"
    names = ["model.a", "draft.model.b", "lm_head.weight"]
    assert split_for_draft(names, "all") == ([1], ["model.b"])
    assert split_for_draft(names, "draft") == ([0, 1, 2], ["model.a", "model.b",
                                                           "lm_head.weight"])
    with pytest.raises(ValueError, match="selector is 'target'"):
        split_for_draft(names, "target")
    check_target_only(None, None)
    check_target_only("target", None)
    with pytest.raises(ValueError, match="selector: this engine has no draft model"):
        check_target_only("draft", None)
    with pytest.raises(ValueError, match="draft_model_path: this engine has no draft model"):
        check_target_only(None, "/some/draft")


def test_an_engine_without_a_draft_refuses_draft_updates(paths: dict[str, str]) -> None:
    for eng in thread_engine(paths["w1"]):
        ok, msg = eng.update_weights_from_tensor(tensors(paths["w2"]), selector="draft")
        assert not ok and "no draft model" in msg
        ok, msg = eng.update_weights_from_tensor(tensors(paths["w2"]), selector="target")
        assert ok, msg


def test_http_routes_carry_the_draft_fields(engine: Any, paths: dict[str, str],
                                            reference: list[dict[str, Any]]) -> None:
    from tests.rollout_engine.engines import app_client

    for client in app_client(engine):
        r = client.post("/update_weights_from_disk", json={"model_path": paths["w1"],
                                                            "selector": "everything"})
        assert r.status_code == 400 and "selector: must be" in r.json()["message"]
        r = client.post("/update_weights_from_disk", json={"model_path": paths["w2"],
                                                            "draft_model_path": paths["w2"]})
        assert r.status_code == 200 and r.json()["success"], r.text
    assert_equal(generate(engine), reference)
