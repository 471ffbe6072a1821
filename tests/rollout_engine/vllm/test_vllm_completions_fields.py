"""vLLM's extra fields on ``/v1/completions`` and ``/v1/chat/completions``: AReaL's vLLM body,
token ids in logprobs and choices, prompt logprobs, prompt truncation, stop strings kept, and
the fields refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.rollout_engine.engines import app_client, thread_engine

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=256)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    yield from app_client(engine)


def post(client: TestClient, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(client: TestClient, ids: list[int], n: int) -> dict[str, Any]:
    return post(client, "/generate", {"input_ids": ids, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": n,
                                                          "temperature": 0.0,
                                                          "ignore_eos": True}})


def areal_body(ids: list[int], max_tokens: int, greedy: bool) -> dict[str, Any]:
    """The body AReaL's vLLM remote engine builds for /v1/completions (its defaults)."""
    return {"top_p": 1.0, "top_k": int(1e8), "max_tokens": max_tokens,
            "temperature": 0.0 if greedy else 1.0, "stop_token_ids": [], "ignore_eos": True,
            "skip_special_tokens": True, "return_tokens_as_token_ids": True, "logprobs": 0,
            "use_beam_search": False, "stream": False, "prompt": list(ids)}


def test_areal_body_parses_as_areal_reads_it(client: TestClient) -> None:
    ref = greedy(client, PROMPT, 5)
    choice = post(client, "/v1/completions", areal_body(PROMPT, 5, greedy=True))["choices"][0]
    # AReaL's parse: tokens "token_id:<id>" split at the colon, token_logprobs as they are
    tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert tokens == ref["output_ids"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [e[0] for e in ref["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert choice["finish_reason"] == "length"
    sampled = post(client, "/v1/completions", areal_body(PROMPT, 3, greedy=False))
    assert len(sampled["choices"][0]["logprobs"]["tokens"]) == 3


def test_return_token_ids_gives_output_and_prompt_ids(client: TestClient) -> None:
    ref = greedy(client, PROMPT, 4)
    choice = post(client, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})["choices"][0]
    assert choice["token_ids"] == ref["output_ids"]
    assert choice["prompt_token_ids"] == PROMPT


def test_prompt_logprobs_per_choice(client: TestClient) -> None:
    scored = post(client, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                        "logprob_start_len": 0,
                                        "sampling_params": {"max_new_tokens": 1}})
    choice = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                              "prompt_logprobs": 2})["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    assert [int(next(iter(e))) for e in entries[1:]] == PROMPT[1:]
    assert [next(iter(e.values()))["logprob"] for e in entries[1:]] == pytest.approx(
        [e[0] for e in scored["meta_info"]["input_token_logprobs"][1:]], abs=1e-4)
    assert all(len(e) <= 3 for e in entries[1:])
    assert choice["logprobs"] is None   # logprobs was not asked for


@pytest.mark.parametrize("side, kept", [(None, PROMPT[-2:]), ("left", PROMPT[-2:]),
                                        ("right", PROMPT[:2])])
def test_truncate_prompt_tokens(client: TestClient, side: Any, kept: list[int]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "truncate_prompt_tokens": 2, "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    data = post(client, "/v1/completions", body)
    assert data["choices"][0]["prompt_token_ids"] == kept
    assert data["usage"]["prompt_tokens"] == 2
    assert data["choices"][0]["token_ids"] == greedy(client, kept, 2)["output_ids"]


def test_include_stop_str_in_output_keeps_the_stop_string(client: TestClient) -> None:
    text = greedy(client, PROMPT, 12)["text"]
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isalpha())
    stop = text[at]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stop": [stop]}
    trimmed = post(client, "/v1/completions", body)["choices"][0]
    kept = post(client, "/v1/completions",
                {**body, "include_stop_str_in_output": True})["choices"][0]
    assert trimmed["stop_reason"] == stop and trimmed["finish_reason"] == "stop"
    assert kept["text"] == trimmed["text"] + stop and not trimmed["text"].endswith(stop)


def test_include_stop_str_in_output_streamed(client: TestClient) -> None:
    text = greedy(client, PROMPT, 12)["text"]
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isalpha())
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stop": [text[at]], "include_stop_str_in_output": True}
    whole = post(client, "/v1/completions", body)["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    streamed = "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1])
    assert streamed == whole and whole.endswith(text[at])


def test_top_k_zero_is_vllms_no_top_k(client: TestClient) -> None:
    base = {"prompt": PROMPT, "max_tokens": 3, "seed": 11, "ignore_eos": True,
            "return_token_ids": True}
    a = post(client, "/v1/completions", {**base, "top_k": 0})["choices"][0]["token_ids"]
    b = post(client, "/v1/completions", base)["choices"][0]["token_ids"]
    assert a == b


def test_chat_token_ids_and_logprob_tokens_as_ids(client: TestClient) -> None:
    data = post(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["top_logprobs"][0]["token"].startswith("token_id:") for e in content)
    assert data["prompt_token_ids"] and len(choice["token_ids"]) == 3


def test_chat_prompt_text_and_accepted_chat_extras(client: TestClient, engine: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    want = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    body = {"messages": messages, "max_tokens": 2, "return_prompt_text": True,
            "include_reasoning": False, "media_io_kwargs": {}, "mm_processor_kwargs": {},
            "echo": False, "documents": [{"title": "t", "text": "d"}]}
    assert post(client, "/v1/chat/completions", body)["prompt_text"] == want
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        first = json.loads(next(ln for ln in r.iter_lines() if ln.startswith("data: "))[6:])
    assert first["prompt_text"] == want
    r = client.post("/v1/chat/completions", json={**body, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("echo:")


def test_chat_documents_reach_the_template(engine: Any) -> None:
    from rollout_engine.entrypoints.chat_template import ChatTemplateRenderer
    from rollout_engine.entrypoints.openai_protocol import ChatCompletionRequest

    req = ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "q"}],
                                       "documents": [{"title": "t", "text": "doc-text"}]})
    renderer = ChatTemplateRenderer(engine.tokenizer, 5.0)
    text = renderer.render([m.template_dict() for m in req.messages], documents=req.documents,
                           template="{% for d in documents %}[{{ d.text }}]{% endfor %}")
    assert text == "[doc-text]"


@pytest.mark.parametrize("field, value", [
    ("routed_experts_prompt_start", 2),
    ("use_beam_search", True), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]),
    ("kv_transfer_params", {"do_remote_prefill": True}),
    ("logprob_token_ids", [3]), ("return_token_offsets", True), ("prompt_logprobs", -2),
])
def test_unsupported_vllm_fields_are_400_naming_them(client: TestClient, field: str,
                                                     value: Any) -> None:
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(route, json={**body, "max_tokens": 1, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{field}:")


def test_no_effect_fields_are_accepted(client: TestClient) -> None:
    r = client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "use_beam_search": False, "length_penalty": 1.0,
        "stream_interval": 2, "vllm_xargs": {"k": 1}, "watermarking": False, "priority": 0,
        "request_id": "vllm-rid", "min_tokens": 1, "spaces_between_special_tokens": False,
        "skip_special_tokens": False, "return_token_offsets": False, "bad_words": []})
    assert r.status_code == 200, r.text
