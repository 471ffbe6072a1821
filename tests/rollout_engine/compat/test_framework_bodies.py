"""The request bodies the RL frameworks that drive SGLang really send, replayed against our
server, and the response fields each of them reads.

The field names and shapes are copied from their source (not their code):

    sglang-router   sgl-router/src/protocols/{generate,sampling_params,chat,completion}.rs:
                    serde serializes every non-Option field (bools with #[serde(default)]),
                    so a forwarded /generate always carries return_text_in_logprobs, stream,
                    log_metrics, return_hidden_states, background, no_logs, return_bytes,
                    return_entropy; a chat request carries separate_reasoning and friends
    AReaL           areal/engine/sglang_remote.py RemoteSGLangEngine.agenerate: image_data
                    (null for text), resumes an interrupted request from its partial tokens
    verl            verl/workers/rollout/sglang_rollout/http_server_engine.py (None-filtered
                    payload) and async_sglang_server.py (a whole GenerateReqInput)
    slime           slime/rollout/sglang_rollout.py GenerateState / generate (custom_params when
                    top_p != 1, no_stop_trim, spaces_between_special_tokens) and
                    sglang_streaming_rollout.py (keeps the last cumulative chunk)
    SGLang frontend python/sglang/lang/ir.py SglSamplingParams.to_srt_kwargs and
                    lang/backend/runtime_endpoint.py (reads data["text"][pos:] while streaming)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from rollout_engine.compat.fields import GENERATE_REQUEST

PROMPT = "The capital of France is"
MAX_NEW = 8


@pytest.fixture(scope="module")
def prompt_ids(engine: Any) -> list[int]:
    return engine.tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def greedy(engine: Any, prompt_ids: list[int]) -> dict[str, Any]:
    """The reference: a plain greedy generation with logprobs."""
    return engine.generate(input_ids=prompt_ids, return_logprob=True,
                           sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0,
                                            "ignore_eos": True})


def _ok(r: Any) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _sse(r: Any) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- sglang-router ------------------------------------------------------------------------------
def _router_generate(**fields: Any) -> dict[str, Any]:
    """What the router forwards for a /generate: its typed GenerateRequest re-serialized."""
    return {**fields, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False}


def test_router_generate_body(client: TestClient, prompt_ids: list[int], greedy: dict) -> None:
    sp = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    out = _ok(client.post("/generate", json=_router_generate(input_ids=prompt_ids,
                                                             sampling_params=sp,
                                                             return_logprob=True,
                                                             rid="router-1")))
    # the router's GenerateResponse reads text, output_ids and these meta_info fields
    assert out["output_ids"] == greedy["output_ids"] and out["text"] == greedy["text"]
    meta = out["meta_info"]
    assert meta["id"] == "router-1" and meta["finish_reason"] == {"type": "length",
                                                                  "length": MAX_NEW}
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                "weight_version"):
        assert key in meta, key
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]

    body = {**_router_generate(text=PROMPT, sampling_params=sp), "stream": True}
    chunks = _sse(client.post("/generate", json=body))
    assert chunks[-1]["output_ids"] == greedy["output_ids"]


def test_router_chat_and_completion_bodies(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "model": "default",
            "logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True,
            "return_hidden_states": False, "max_completion_tokens": 4, "temperature": 0.0}
    out = _ok(client.post("/v1/chat/completions", json=chat))
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < out["usage"]["completion_tokens"] <= 4
    completion = {"model": "default", "prompt": PROMPT, "max_tokens": 4, "stream": False,
                  "echo": False, "no_stop_trim": False, "ignore_eos": False,
                  "skip_special_tokens": True, "return_hidden_states": False,
                  "temperature": 0.0}
    out = _ok(client.post("/v1/completions", json=completion))
    assert out["choices"][0]["text"] and out["usage"]["prompt_tokens"] > 0


# -- AReaL --------------------------------------------------------------------------------------
def test_areal_body_and_resume_from_partial_tokens(client: TestClient, engine: Any,
                                                   prompt_ids: list[int], greedy: dict) -> None:
    """AReaL sends image_data (null for text), reads finish_reason.type and
    output_token_logprobs, and resumes an interrupted request with the tokens so far appended
    to input_ids and max_new_tokens reduced; the pieces add up to one uninterrupted run."""
    eos = engine.tokenizer.eos_token_id
    sample_params = {"top_p": 1.0, "top_k": -1, "max_new_tokens": 3, "temperature": 0.0,
                     "stop_token_ids": [eos] if eos is not None else [],
                     "frequency_penalty": 0.0, "ignore_eos": True}
    payload = {"input_ids": list(prompt_ids), "image_data": None,
               "sampling_params": sample_params, "return_logprob": True, "stream": False}
    tokens: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < MAX_NEW:
        result = _ok(client.post("/generate", json=payload))
        meta = result["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
        new = [x[1] for x in meta["output_token_logprobs"]]
        tokens += new
        logprobs += [x[0] for x in meta["output_token_logprobs"]]
        payload["input_ids"] += new
        sample_params["max_new_tokens"] = min(3, MAX_NEW - len(tokens))
    assert tokens == greedy["output_ids"]
    want = [lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(want, abs=1e-4)


# -- verl ---------------------------------------------------------------------------------------
def test_verl_http_engine_body(client: TestClient, prompt_ids: list[int], greedy: dict) -> None:
    """http_server_engine.generate: every argument, then the None values filtered out."""
    payload = {"text": None, "sampling_params": {
        "n": 1, "max_new_tokens": MAX_NEW, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "repetition_penalty": 1.0, "temperature": 0.0, "top_k": -1, "top_p": 1.0,
        "ignore_eos": True}, "input_ids": prompt_ids, "image_data": None,
        "return_logprob": True, "logprob_start_len": None, "top_logprobs_num": None,
        "token_ids_logprob": None, "lora_path": None, "custom_logit_processor": None}
    filtered = {k: v for k, v in payload.items() if v is not None}
    for body in (filtered, payload):   # and unfiltered: null is accepted everywhere
        out = _ok(client.post("/generate", json=body))
        log_probs, token_ids = zip(*[(lp, t) for lp, t, _ in
                                     out["meta_info"]["output_token_logprobs"]])
        assert list(token_ids) == greedy["output_ids"] == out["output_ids"]


def test_verl_whole_generate_req_input(client: TestClient, prompt_ids: list[int],
                                       greedy: dict) -> None:
    """async_sglang_server builds GenerateReqInput(rid, input_ids, sampling_params,
    return_logprob, image_data=None): as a body, every field at its dataclass default."""
    body = {f.name: f.default for f in GENERATE_REQUEST}
    body.update(rid="verl-req-1", input_ids=prompt_ids, image_data=None, return_logprob=True,
                sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0,
                                 "ignore_eos": True})
    out = _ok(client.post("/generate", json=body))
    assert out["meta_info"]["id"] == "verl-req-1"
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == greedy["output_ids"]


# -- slime --------------------------------------------------------------------------------------
def _slime_sampling_params(top_p: float) -> dict[str, Any]:
    """GenerateState.sampling_params, with the rollout args a run sets."""
    params: dict[str, Any] = dict(temperature=1.0, top_p=top_p, top_k=-1,
                                  max_new_tokens=MAX_NEW, stop=None, stop_token_ids=None,
                                  skip_special_tokens=False, no_stop_trim=True,
                                  spaces_between_special_tokens=False)
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_slime_generate_body(client: TestClient, prompt_ids: list[int], top_p: float) -> None:
    sp = {**_slime_sampling_params(top_p), "sampling_seed": 1234}
    output = _ok(client.post("/generate", json={"sampling_params": sp, "return_logprob": True,
                                                "input_ids": prompt_ids}))
    meta = output["meta_info"]
    new_tokens = [item[1] for item in meta["output_token_logprobs"]]
    new_log_probs = [item[0] for item in meta["output_token_logprobs"]]
    assert new_tokens == output["output_ids"] and len(new_log_probs) == len(new_tokens)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert isinstance(output["text"], str) and meta["weight_version"] == "default"
    again = _ok(client.post("/generate", json={"sampling_params": sp, "return_logprob": True,
                                               "input_ids": prompt_ids}))
    assert again["output_ids"] == output["output_ids"]   # sampling_seed: deterministic groups


def test_slime_streaming_reader_keeps_the_last_chunk(client: TestClient,
                                                     prompt_ids: list[int]) -> None:
    """sglang_streaming_rollout rebuilds the sample from each chunk as if it were the whole
    call so far (text and output_token_logprobs): with delta chunks it kept only the last
    chunk's tokens; with SGLang's cumulative chunks it matches the non-streaming call."""
    sp = {**_slime_sampling_params(0.9), "sampling_seed": 99, "ignore_eos": True}
    payload = {"sampling_params": sp, "return_logprob": True, "input_ids": prompt_ids}
    whole = _ok(client.post("/generate", json=payload))
    call_text, call_tokens, call_log_probs, last_meta = "", [], [], {}
    for chunk in _sse(client.post("/generate", json={**payload, "stream": True})):
        meta = chunk.get("meta_info") or {}
        last_meta = meta
        call_text = chunk.get("text", call_text)
        if "output_token_logprobs" in meta:
            call_tokens = [item[1] for item in meta["output_token_logprobs"]]
            call_log_probs = [item[0] for item in meta["output_token_logprobs"]]
    assert call_tokens == whole["output_ids"] and len(call_tokens) == MAX_NEW
    assert call_text == whole["text"]
    want = [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]]
    assert call_log_probs == pytest.approx(want, abs=1e-5)
    assert last_meta["finish_reason"] == whole["meta_info"]["finish_reason"]


# -- SGLang's frontend language -------------------------------------------------------------------
def _frontend_sampling_params(**over: Any) -> dict[str, Any]:
    """RuntimeEndpoint.generate: the global detokenization flags + to_srt_kwargs() of an
    SglSamplingParams at its defaults (its stop / stop_token_ids / stop_regex default to ())."""
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
              "max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [],
              "stop_token_ids": [], "stop_regex": [], "temperature": 1.0, "top_p": 1.0,
              "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "ignore_eos": False, "regex": None, "json_schema": None}
    params.update(over)
    return params


def test_frontend_gen_and_stream(client: TestClient) -> None:
    data = {"text": PROMPT, "sampling_params": _frontend_sampling_params(
        max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)}
    whole = _ok(client.post("/generate", json=data))
    assert whole["meta_info"]["completion_tokens"] == MAX_NEW
    # generate_stream: `chunk_text = data["text"][pos:]; pos += len(chunk_text)`
    pos, pieces = 0, []
    for chunk in _sse(client.post("/generate", json={**data, "stream": True})):
        chunk_text = chunk["text"][pos:]
        pos += len(chunk_text)
        pieces.append(chunk_text)
    assert "".join(pieces) == whole["text"]


def test_frontend_select_body(client: TestClient, engine: Any) -> None:
    """select scores each choice by its prompt logprobs: a batch, no new tokens."""
    choices = [" Paris", " Berlin"]
    prompt_len = len(engine.tokenizer.encode(PROMPT, add_special_tokens=False))
    data = {"text": [PROMPT + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 2, 0)}
    outs = _ok(client.post("/generate", json=data))
    assert len(outs) == 2
    for out in outs:
        entries = out["meta_info"]["input_token_logprobs"]
        assert entries and all(isinstance(text, str) for _, _, text in entries)
        assert out["output_ids"] == []
