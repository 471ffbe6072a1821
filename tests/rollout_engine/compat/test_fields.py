"""SGLang's request surface, enumerated: every field of GenerateReqInput, SamplingParams and the
OpenAI requests is accepted at null / its default with a normal result; every
accepted-if-default field refuses a real value with a 400 naming it; ignored fields change
nothing; a name SGLang does not know either stays a 400."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from rollout_engine.compat.fields import (
    CHAT_REQUEST,
    COMPLETION_REQUEST,
    GENERATE_REQUEST,
    SAMPLING_PARAMS,
    FieldList,
    SglangField,
    Treatment,
)
from rollout_engine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from rollout_engine.sampling_params import SamplingParams

S, D, X = Treatment.SUPPORTED, Treatment.DEFAULT_ONLY, Treatment.IGNORED
GREEDY = {"max_new_tokens": 2, "temperature": 0.0}
PROMPT_IDS = [5, 40, 100, 7]
MESSAGES = [{"role": "user", "content": "hello there"}]

# A real (non-default) value for every accepted-if-default field, as a client would send it.
GENERATE_REFUSED = {
    "session_params": {"id": "session-1"},
    "input_embeds": [[0.1, 0.2]], "image_data": "https://example.com/cat.png",
    "video_data": "clip.mp4", "audio_data": "speech.wav", "mm_hashes": ["ab12"],
    "mm_content_hashes": ["sha256:" + "0" * 64], "use_audio_in_video": True,
    "video_config": {"fps": 2}, "modalities": ["image"], "max_dynamic_patch": 6,
    "min_dynamic_patch": 1, "image_max_dynamic_patch": 6, "video_max_dynamic_patch": 2,
    "images_config": {"max_pixels": 1024}, "need_wait_for_mm_inputs": True,
    "num_items_assigned": {"image": [1]}, "encoder_urls": ["http://encoder:8000"],
    "return_sampling_mask": True, "return_flat_raw_top_logprobs": True,
    "return_flat_raw_top_logprobs_b64": True, "return_hidden_states": True,
    "return_indexer_topk": True,
    "lora_id": "math-1",
    "custom_logit_processor": '{"callable": "gASV..."}', "positional_embed_overrides": [[0.5]],
    "bootstrap_pair_key": "pair", "decode_tp_size": 2, "disagg_prefill_dp_rank": 1,
    "routed_dp_rank": 1, "data_parallel_rank": 3, "http_worker_ipc": "ipc:///tmp/worker",
    "background": True, "require_reasoning": True, "max_thinking_tokens": 64,
    "return_bytes": True, "return_entropy": True, "return_prompt_token_ids": True,
    "multi_item_delimiter_indices": [1, 3],
}
GENERATE_IGNORED = {
    "session_id": "session-7", "log_metrics": False, "no_logs": True,
    "custom_labels": {"team": "rl"}, "priority": 5, "routing_key": "tenant-a",
    "kv_router_hint": {"source_control_endpoint": "x", "block_hashes": ["h"]},
    "conversation_id": "conv-1", "external_trace_header": {"traceparent": "00-ab-cd-01"},
    "received_time": 1.7e9, "model": "default",
}
# json_schema / regex / ebnf / structural_tag are supported fields (checked, then refused
# until the scheduler applies grammars): tests/rollout_engine/constrained/test_request_fields.py
SAMPLING_REFUSED = {"stop_regex": r"\d+", "logit_bias": {"5": 2.0}, "beam_width": 4}
SAMPLING_IGNORED = {"stream_interval": 4}
OPENAI_COMMON_REFUSED = {
    "logit_bias": {"5": 2.0}, "return_hidden_states": True, "return_cached_tokens_details": True,
    "stop_regex": [r"\d"], "session_params": {"id": "s"},
    "custom_logit_processor": '{"callable": "gASV..."}', "images_config": {"max_pixels": 9},
    "routed_dp_rank": 2, "disagg_prefill_dp_rank": 1, "data_parallel_rank": 1,
}
OPENAI_COMMON_IGNORED = {
    "user": "user-1", "session_id": "s-1",
    "custom_params": {"return_top_p_token_ids": True}, "ngram_corpus_id": "corpus",
    "priority": 3, "custom_labels": {"team": "rl"},
}
COMPLETION_REFUSED = {**OPENAI_COMMON_REFUSED, "suffix": " the end"}
COMPLETION_IGNORED = OPENAI_COMMON_IGNORED
CHAT_REFUSED = {
    **OPENAI_COMMON_REFUSED,
    "task": "domain",
    "max_dynamic_patch": 6, "min_dynamic_patch": 1, "use_audio_in_video": True,
    "verbosity": "low", "modalities": ["text", "audio"], "function_call": "auto",
    "functions": [{"name": "lookup"}],
}
CHAT_IGNORED = {
    **OPENAI_COMMON_IGNORED, "metadata": {"run": "7"}, "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "sid",
}
# the request itself: not sent on their own
GENERATE_BASE = {"text", "input_ids", "sampling_params"}


def _params(fields: FieldList, treatment: Treatment, skip: set[str] = frozenset()) -> Any:
    return pytest.mark.parametrize(
        "field", [f for f in fields if f.treatment is treatment and f.name not in skip],
        ids=lambda f: f.name)


# -- the lists themselves -----------------------------------------------------------------------
@pytest.mark.parametrize("fields, refused, ignored", [
    (GENERATE_REQUEST, GENERATE_REFUSED, GENERATE_IGNORED),
    (SAMPLING_PARAMS, SAMPLING_REFUSED, SAMPLING_IGNORED),
    (COMPLETION_REQUEST, COMPLETION_REFUSED, COMPLETION_IGNORED),
    (CHAT_REQUEST, CHAT_REFUSED, CHAT_IGNORED),
], ids=lambda v: v.name if isinstance(v, FieldList) else None)
def test_every_listed_field_has_a_test_value(fields: FieldList, refused: dict,
                                             ignored: dict) -> None:
    """A field added to a list without a test value fails here, so the tests below cover it."""
    assert set(refused) == fields.names(D)
    assert set(ignored) == fields.names(X)
    for name, value in refused.items():
        assert not fields[name].is_default(value), name


def test_supported_sampling_params_are_exactly_our_dataclass() -> None:
    assert SAMPLING_PARAMS.names(S) == {f.name for f in dataclasses.fields(SamplingParams)}
    for f in dataclasses.fields(SamplingParams):
        listed = SAMPLING_PARAMS[f.name].default
        ours = f.default if f.default is not dataclasses.MISSING else None
        assert listed == ours or (listed is None and ours == []), f.name


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest],
                         ids=lambda m: m.__name__)
def test_supported_openai_fields_are_typed_by_our_schema(model: Any) -> None:
    assert model.FIELDS.names(S) <= set(model.model_fields)
    # nothing SGLang treats as unsupported is typed (and so silently accepted) by the schema
    assert not model.FIELDS.names(D, X) & set(model.model_fields)


def test_engine_generate_names_the_supported_fields() -> None:
    from rollout_engine.entrypoints.engine import Engine

    for fn in (Engine.generate, Engine.async_generate):
        params = set(inspect.signature(fn).parameters)
        assert GENERATE_REQUEST.names(S) - {"text"} <= params
        assert "prompt" in params and "text" not in params


def test_lists_are_documented() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "API.md").read_text()
    for fields in (GENERATE_REQUEST, SAMPLING_PARAMS, COMPLETION_REQUEST, CHAT_REQUEST):
        assert fields.markdown() in doc, f"docs/API.md: regenerate the {fields.name} table"


def test_default_rules() -> None:
    lora = GENERATE_REQUEST["lora_id"]
    assert lora.is_default(None) and lora.is_default([None, None]) and lora.is_default("")
    assert not lora.is_default(["a", None])
    hidden = GENERATE_REQUEST["return_hidden_states"]
    assert hidden.is_default(False) and not hidden.is_default(0) and not hidden.is_default("last")
    assert GENERATE_REQUEST["routed_dp_rank"].is_default(0)
    assert SAMPLING_PARAMS["stop_regex"].is_default([])   # SGLang's frontend sends ()
    with pytest.raises(ValueError, match=r"^x\.lora_id: lora_id is not supported by this engine: .*lora_path"):
        lora.check("adapter-1", "x.")
    SglangField("f", 1, X, "n").check("anything")       # ignored: never refused
    with pytest.raises(ValueError, match="listed twice"):
        FieldList("L", "src", [SglangField("a", 0, S, ""), SglangField("a", 0, X, "")])


# -- /generate ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(engine: Any) -> dict[str, Any]:
    return engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)


def _generate(client: TestClient, **fields: Any) -> Any:
    body = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, **fields}
    return client.post("/generate", json=body)


def _normal(r: Any, baseline: dict[str, Any]) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == baseline["output_ids"] and out["text"] == baseline["text"]
    assert out["meta_info"]["finish_reason"] == baseline["meta_info"]["finish_reason"]
    return out


def _stream_last(r: Any) -> dict[str, Any]:
    import json

    assert r.status_code == 200, r.text
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])


@_params(GENERATE_REQUEST, S, skip=GENERATE_BASE)
def test_generate_accepts_supported_field_at_default(client: TestClient, baseline: dict,
                                                     field: SglangField) -> None:
    for value in (None, field.default):
        r = _generate(client, **{field.name: value})
        if field.name == "stream" and value:
            assert _stream_last(r)["output_ids"] == baseline["output_ids"]
        else:
            _normal(r, baseline)


@_params(GENERATE_REQUEST, D)
def test_generate_accepts_unsupported_field_at_default(client: TestClient, baseline: dict,
                                                       field: SglangField) -> None:
    for value in (None, field.default, *field.also_default):
        _normal(_generate(client, **{field.name: value}), baseline)


@_params(GENERATE_REQUEST, D)
def test_generate_refuses_unsupported_field_with_400(client: TestClient, engine: Any,
                                                     field: SglangField) -> None:
    before = engine.get_server_info()["stats"]["prompt_tokens"]
    r = _generate(client, **{field.name: GENERATE_REFUSED[field.name]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field.name}: ")
    assert "not supported by this engine" in message
    assert engine.get_server_info()["stats"]["prompt_tokens"] == before, "a refused call ran"


@_params(GENERATE_REQUEST, X)
def test_generate_ignores_ignored_field(client: TestClient, baseline: dict,
                                        field: SglangField) -> None:
    for value in (None, field.default, GENERATE_IGNORED[field.name]):
        _normal(_generate(client, **{field.name: value}), baseline)


def test_generate_unknown_fields_stay_400(client: TestClient) -> None:
    r = _generate(client, not_an_sglang_field=1)
    assert r.status_code == 400 and "not_an_sglang_field" in r.json()["error"]["message"]
    r = _generate(client, sampling_params={**GREEDY, "tempreature": 0.5})
    assert r.status_code == 400 and "tempreature" in r.json()["error"]["message"]


@_params(SAMPLING_PARAMS, S)
def test_sampling_params_accept_supported_field_at_default(client: TestClient, baseline: dict,
                                                           field: SglangField) -> None:
    for value in (None, field.default):
        r = _generate(client, sampling_params={**GREEDY, field.name: value})
        if field.name in GREEDY:   # null or the default replaces the test's own value
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        else:
            _normal(r, baseline)


@_params(SAMPLING_PARAMS, D)
def test_sampling_params_accept_unsupported_field_at_default(client: TestClient, baseline: dict,
                                                             field: SglangField) -> None:
    for value in (None, field.default, *field.also_default):
        _normal(_generate(client, sampling_params={**GREEDY, field.name: value}), baseline)


@_params(SAMPLING_PARAMS, D)
def test_sampling_params_refuse_unsupported_field_with_400(client: TestClient,
                                                           field: SglangField) -> None:
    r = _generate(client, sampling_params={**GREEDY, field.name: SAMPLING_REFUSED[field.name]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"sampling_params.{field.name}: ")
    assert "not supported by this engine" in message


@_params(SAMPLING_PARAMS, X)
def test_sampling_params_ignore_ignored_field(client: TestClient, baseline: dict,
                                              field: SglangField) -> None:
    value = SAMPLING_IGNORED[field.name]
    _normal(_generate(client, sampling_params={**GREEDY, field.name: value}), baseline)


# -- Engine.generate keyword arguments ------------------------------------------------------------
@_params(GENERATE_REQUEST, D)
def test_engine_kwargs_follow_the_same_rules(engine: Any, baseline: dict,
                                             field: SglangField) -> None:
    out = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY,
                          **{field.name: field.default})
    assert out["output_ids"] == baseline["output_ids"]
    with pytest.raises(ValueError, match=f"^{field.name}: .*not supported by this engine"):
        engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY,
                        **{field.name: GENERATE_REFUSED[field.name]})
    assert not engine.tm.states, "a refused call left requests in flight"


def test_engine_kwargs_ignored_and_unknown(engine: Any, baseline: dict) -> None:
    out = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY, **GENERATE_IGNORED)
    assert out["output_ids"] == baseline["output_ids"]
    with pytest.raises(TypeError, match="not_an_sglang_field"):
        engine.generate(input_ids=PROMPT_IDS, not_an_sglang_field=1)
    with pytest.raises(TypeError, match="prompt="):
        engine.generate(text="hello")          # SGLang's Engine calls it prompt too

    async def run() -> Any:
        return await engine.async_generate(input_ids=PROMPT_IDS, sampling_params=GREEDY,
                                           image_data=None, lora_path=None, priority=1)

    import asyncio

    assert asyncio.run(run())["output_ids"] == baseline["output_ids"]
    with pytest.raises(ValueError, match="^lora_path: "):
        asyncio.run(engine.async_generate(input_ids=PROMPT_IDS, lora_path="a"))


# -- supported fields that map onto ours ----------------------------------------------------------
def test_rid_forms(client: TestClient) -> None:
    r = client.post("/generate", json={"text": ["a b", "c d"], "sampling_params": GREEDY,
                                       "rid": "batch"})
    assert [o["meta_info"]["id"] for o in r.json()] == ["batch_0", "batch_1"]   # SGLang's names
    r = client.post("/generate", json={"text": ["a b", "c d"], "sampling_params": GREEDY,
                                       "rid": ["x", "y"]})
    assert [o["meta_info"]["id"] for o in r.json()] == ["x", "y"]
    r = client.post("/generate", json={"text": "a b", "sampling_params": GREEDY, "rid": "one"})
    assert r.json()["meta_info"]["id"] == "one"


def test_per_prompt_logprob_lists(client: TestClient) -> None:
    r = client.post("/generate", json={
        "input_ids": [PROMPT_IDS, PROMPT_IDS[:3]], "sampling_params": GREEDY,
        "return_logprob": [True, False], "top_logprobs_num": [2, 0],
        "logprob_start_len": [1, -1]})
    assert r.status_code == 200, r.text
    first, second = (o["meta_info"] for o in r.json())
    assert len(first["output_top_logprobs"][0]) == 2
    assert [t for _, t, _ in first["input_token_logprobs"]] == PROMPT_IDS[1:]
    assert "output_token_logprobs" not in second


def test_return_text_in_logprobs_fills_sglang_tuples(client: TestClient, engine: Any) -> None:
    body = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0}
    plain = client.post("/generate", json=body).json()["meta_info"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])
    with_text = client.post("/generate", json={**body, "return_text_in_logprobs": True}).json()
    decode = engine.tokenizer.decode
    for key in ("output_token_logprobs", "input_token_logprobs"):
        for _, tid, text in with_text["meta_info"][key]:
            assert text == decode([tid], skip_special_tokens=False)
    for top in with_text["meta_info"]["output_top_logprobs"]:
        assert all(text == decode([tid], skip_special_tokens=False) for _, tid, text in top)
    out = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY, return_logprob=True,
                          return_text_in_logprobs=True)
    assert [e[1:] for e in out["meta_info"]["output_token_logprobs"]] == \
        [e[1:] for e in with_text["meta_info"]["output_token_logprobs"]]


def test_extra_key_and_cache_salt_namespace_the_prefix_cache(client: TestClient,
                                                             engine: Any) -> None:
    engine.flush_cache()
    prompt = list(range(20, 60))

    def cached(**keys: Any) -> int:
        r = client.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY,
                                           **keys})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(extra_key="tenant-a") == 0
    assert cached(extra_key="tenant-a") > 0
    assert cached(extra_key="tenant-a", cache_salt="salt") == 0   # another namespace
    assert cached(extra_key="tenant-a", cache_salt="salt") > 0
    assert cached(cache_salt="salt") == 0
    assert cached(extra_key="", cache_salt=None) == 0              # "" means none, as SGLang
    assert cached() > 0


# -- OpenAI routes --------------------------------------------------------------------------------
ROUTES = {
    "completion": ("/v1/completions", COMPLETION_REQUEST, COMPLETION_REFUSED, COMPLETION_IGNORED,
                   {"prompt": "hello there", "max_tokens": 2, "temperature": 0.0}),
    "chat": ("/v1/chat/completions", CHAT_REQUEST, CHAT_REFUSED, CHAT_IGNORED,
             {"messages": MESSAGES, "max_tokens": 2, "temperature": 0.0}),
}
OPENAI_BASE = {"prompt", "messages"}
# sent alone, these change the request away from the 2-token greedy baseline
OPENAI_RESHAPING = {"max_tokens", "temperature", "max_completion_tokens", "top_p", "n",
                    "input_ids"}


def _openai_cases(treatment: Treatment) -> list[Any]:
    return [pytest.param(kind, f, id=f"{kind}-{f.name}")
            for kind, (_, fields, *_rest) in ROUTES.items()
            for f in fields if f.treatment is treatment and f.name not in OPENAI_BASE]


@pytest.fixture(scope="module")
def openai_baseline(client: TestClient) -> dict[str, str]:
    return {kind: client.post(path, json=base).json()["choices"][0]
            for kind, (path, _f, _r, _i, base) in ROUTES.items()}


def _openai(client: TestClient, kind: str, **fields: Any) -> Any:
    path, _f, _r, _i, base = ROUTES[kind]
    return client.post(path, json={**base, **fields})


def _text(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("kind, field", _openai_cases(S) + _openai_cases(D) + _openai_cases(X))
def test_openai_accepts_every_field_at_default(client: TestClient, openai_baseline: dict,
                                               kind: str, field: SglangField) -> None:
    for value in (None, field.default, *field.also_default):
        if field.name in ("stream", "echo") and value:
            continue
        r = _openai(client, kind, **{field.name: value})
        assert r.status_code == 200, (field.name, value, r.text)
        if field.name not in OPENAI_RESHAPING:
            assert _text(r.json()["choices"][0]) == _text(openai_baseline[kind])


@pytest.mark.parametrize("kind, field", _openai_cases(D))
def test_openai_refuses_unsupported_field_with_400(client: TestClient, kind: str,
                                                   field: SglangField) -> None:
    refused = ROUTES[kind][2]
    r = _openai(client, kind, **{field.name: refused[field.name]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field.name}: ")
    assert "not supported by this engine" in message


@pytest.mark.parametrize("kind, field", _openai_cases(X))
def test_openai_ignores_ignored_field(client: TestClient, openai_baseline: dict, kind: str,
                                      field: SglangField) -> None:
    r = _openai(client, kind, **{field.name: ROUTES[kind][3][field.name]})
    assert r.status_code == 200, r.text
    assert _text(r.json()["choices"][0]) == _text(openai_baseline[kind])


def test_openai_unknown_field_stays_400(client: TestClient) -> None:
    for kind in ROUTES:
        r = _openai(client, kind, not_an_sglang_field=1)
        assert r.status_code == 400 and "not_an_sglang_field" in r.json()["error"]["message"]


def test_openai_sglang_extensions_map(client: TestClient, engine: Any,
                                      openai_baseline: dict) -> None:
    # sampling_seed is the router's name for seed
    a = _openai(client, "completion", temperature=1.0, max_tokens=6, seed=11).json()
    b = _openai(client, "completion", temperature=1.0, max_tokens=6, sampling_seed=11).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    r = _openai(client, "completion", seed=1, sampling_seed=2)
    assert r.status_code == 400 and "sampling_seed" in r.json()["error"]["message"]
    # chat input_ids bypass the template: same ids, same answer
    text = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                tokenize=False)
    r = _openai(client, "chat", input_ids=engine.tokenizer.encode(text, add_special_tokens=False))
    assert _text(r.json()["choices"][0]) == _text(openai_baseline["chat"])
    # reasoning_effort reaches the template as SGLang passes it
    r = _openai(client, "chat", reasoning_effort="none", rid="effort-1")
    assert r.status_code == 200, r.text
    r = _openai(client, "chat", reasoning_effort=1.5)
    assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]
