"""Reloading an adapter under the same name: nothing computed under the old weights is reused
(vLLM's same-name reload reused prefix-cache blocks of the previous adapter), an upsert lets
requests already taken finish on the version they were bound to while later ones use the new
one, and an aborted LoRA request ends at once and lets its adapter go."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from tests.rollout_engine.lora.adapters import AdapterSpec, assert_matches, prompts

GREEDY = {"temperature": 0, "max_new_tokens": 8}
ENDLESS = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
V2 = AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"), seed=11)


def _gen(engine: Any, prompt: list[int], adapter: Optional[str], **params: Any) -> dict:
    return engine.generate(input_ids=prompt, lora_path=adapter, return_logprob=True,
                           sampling_params={**GREEDY, **params})


def _info(engine: Any) -> dict[str, Any]:
    return engine.get_server_info()


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    for (x, _, _), (y, _, _) in zip(a["meta_info"]["output_token_logprobs"],
                                    b["meta_info"]["output_token_logprobs"]):
        assert abs(x - y) < 1e-5


def test_a_reloaded_adapter_never_reuses_kv_of_its_old_weights(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        build_adapter: Callable[..., str], vocab: int) -> None:
    v1, v2 = adapters["all8"], build_adapter(qwen2_path, "all8-v2", V2)
    engine = make_engine(qwen2_path, enable_lora=True, max_lora_rank=8,
                         lora_target_modules=["all"])
    engine.load_lora_adapter("x", v1)
    prompt = prompts(vocab, [40], seed=5)[0]
    first = _gen(engine, prompt, "x")
    assert_matches(qwen2_path, v1, prompt, first, GREEDY["max_new_tokens"])
    assert _gen(engine, prompt, "x")["meta_info"]["cached_tokens"] == 39   # same version: reused
    assert _gen(engine, prompt, None)["meta_info"]["cached_tokens"] == 0    # the base: its own
    # unload + load under the same name, new weights
    engine.unload_lora_adapter("x")
    engine.load_lora_adapter("x", v2)
    after = _gen(engine, prompt, "x")
    assert after["meta_info"]["cached_tokens"] == 0
    fresh = make_engine(qwen2_path, lora_paths=[f"x={v2}"])
    _same(after, _gen(fresh, prompt, "x"))
    assert_matches(qwen2_path, v2, prompt, after, GREEDY["max_new_tokens"])
    # an upsert back to the first weights: a new version again, nothing of either reused
    engine.load_lora_adapter("x", v1, upsert=True)
    back = _gen(engine, prompt, "x")
    assert back["meta_info"]["cached_tokens"] == 0
    _same(back, first)


def test_upsert_under_load(make_engine: Callable[..., Any], qwen2_path: str,
                           adapters: dict[str, str], build_adapter: Callable[..., str],
                           vocab: int) -> None:
    """A request decoding and one queued when the upsert arrives finish on the old weights;
    one sent after it uses the new, in the same batches; each equals a fresh engine's."""
    v1, v2 = adapters["all8"], build_adapter(qwen2_path, "all8-v2", V2)
    engine = make_engine(qwen2_path, lora_paths=[f"x={v1}"])
    running_p, queued_p, probe_p = prompts(vocab, [21, 13, 17], seed=9)
    running = engine.generate(input_ids=running_p, lora_path="x", stream=True,
                              return_logprob=True, rid="running", sampling_params=ENDLESS)
    next(running)                                        # it decodes
    engine.pause_generation("in_place")
    assert _info(engine)["num_running_reqs"] == 1
    queued = engine.generate(input_ids=queued_p, lora_path="x", stream=True,
                             return_logprob=True, sampling_params=GREEDY)   # taken, waiting
    engine.load_lora_adapter("x", v2, upsert=True)
    probe = engine.generate(input_ids=probe_p, lora_path="x", stream=True,
                            return_logprob=True, sampling_params=GREEDY)
    engine.continue_generation()
    queued_out, probe_out = list(queued)[-1], list(probe)[-1]
    for chunk in running:                                # well past the upsert, then stop it
        if len(chunk["output_ids"]) >= 40:
            engine.abort_request("running")
    running_out = chunk
    assert running_out["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(running_out["output_ids"])
    old = make_engine(qwen2_path, lora_paths=[f"x={v1}"])
    expected = _gen(old, running_p, "x", max_new_tokens=n, ignore_eos=True)
    _same(running_out, expected)
    _same(queued_out, _gen(old, queued_p, "x"))
    new = make_engine(qwen2_path, lora_paths=[f"x={v2}"])
    _same(probe_out, _gen(new, probe_p, "x"))
    assert_matches(qwen2_path, v2, probe_p, probe_out, GREEDY["max_new_tokens"])
    # every request let its version go: the old one is dropped, the name unloads
    assert _info(engine)["loaded_adapters"]["x"]["version"] == 2
    engine.unload_lora_adapter("x")
    assert _info(engine)["loaded_adapters"] == {}


def test_abort_ends_a_lora_request_at_once_and_frees_its_adapter(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        vocab: int) -> None:
    engine = make_engine(qwen2_path, lora_paths=[f"x={adapters['all8']}"])
    prompt = prompts(vocab, [12], seed=3)[0]
    stream = engine.generate(input_ids=prompt, lora_path="x", stream=True, rid="lora-long",
                             sampling_params=ENDLESS)
    first = next(stream)
    t0 = time.monotonic()
    engine.abort_request("lora-long")
    last = list(stream)[-1]
    assert time.monotonic() - t0 < 10
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(first["output_ids"]) <= len(last["output_ids"]) < ENDLESS["max_new_tokens"]
    engine.unload_lora_adapter("x")          # its adapter is in use by no one now
    engine.check_integrity()
