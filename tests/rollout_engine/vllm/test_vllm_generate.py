"""``POST /inference/v1/generate`` (vLLM's token-in, token-out route) over a live uvicorn server:
the bodies prime-rl's clients send, the fields they read, streaming, n > 1, prompt logprobs,
stop reasons, cache_salt namespaces and vLLM's error answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_engine.entrypoints.vllm_output import weight_version_spans
from tests.rollout_engine.engines import served_over_http, thread_engine

CONTEXT = 64
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=CONTEXT)


@pytest.fixture(scope="module")
def http(engine: Any) -> Iterator[httpx.Client]:
    for url in served_over_http(engine):
        with httpx.Client(base_url=url, timeout=60.0) as client:
            yield client


def generate(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def native(http: httpx.Client, ids: list[int], **params: Any) -> dict[str, Any]:
    r = http.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                     "sampling_params": {"temperature": 0.0, **params}})
    assert r.status_code == 200, r.text
    return r.json()


def test_renderers_body_answers_what_the_client_reads(http: httpx.Client, engine: Any) -> None:
    """The body prime-rl's renderer client sends, and every field it reads back."""
    body = {"model": engine.config.model_path, "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                "min_p": 0.01, "repetition_penalty": 1.1, "logprobs": 1,
                                "skip_special_tokens": False, "stop_token_ids": [],
                                "seed": 7},
            "cache_salt": "salt-renderers", "priority": 0}
    data = generate(http, body)
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 6 and choice["finish_reason"] in ("stop", "length")
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == ids
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(e["logprob"] <= 0.0 and e["top_logprobs"][0]["token_id"] == e["token_id"]
               for e in content)
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == len(PROMPT) + len(ids)
    assert data["request_id"].startswith("generate-tokens-")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]
    # seeded: the same body gives the same tokens; the prompt is now cached (and said so)
    again = generate(http, body)
    assert again["choices"][0]["token_ids"] == ids
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PROMPT) - 1


def test_skyrl_body_and_reads(http: httpx.Client, engine: Any) -> None:
    """SkyRL's RemoteInferenceClient: vLLM SamplingParams as its config gives them, the served
    model's name, a session header; it reads token_ids, finish_reason and each
    logprobs.content[].logprob, then detokenizes the ids through /detokenize."""
    payload = {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                   "max_tokens": 5, "logprobs": 0, "stop": None,
                                   "include_stop_str_in_output": False,
                                   "skip_special_tokens": True, "n": 1},
               "model": engine.config.model_path, "token_ids": PROMPT}
    r = http.post("/inference/v1/generate", json=payload, headers={"X-Session-ID": "s-1"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert len(logprobs) == len(choice["token_ids"]) >= 1
    assert choice["finish_reason"] in ("stop", "length")
    text = http.post("/detokenize", json={"model": engine.config.model_path,
                                          "tokens": choice["token_ids"]}).json()["prompt"]
    assert text == engine.tokenizer.decode(choice["token_ids"])


def test_greedy_matches_native_generate(http: httpx.Client) -> None:
    ref = native(http, PROMPT, max_new_tokens=5, ignore_eos=True)
    data = generate(http, {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 5, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}})
    choice = data["choices"][0]
    assert choice["token_ids"] == ref["output_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [e[0] for e in ref["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None


def test_max_tokens_unset_fills_the_context(http: httpx.Client) -> None:
    """vLLM's server-side default: what the context leaves, not SamplingParams' 16."""
    data = generate(http, {"token_ids": PROMPT, "sampling_params": {
        "temperature": 0.0, "ignore_eos": True}})
    assert len(data["choices"][0]["token_ids"]) == CONTEXT - len(PROMPT)


def test_n_samples_are_choices_and_prompt_counts_once(http: httpx.Client) -> None:
    data = generate(http, {"token_ids": PROMPT, "sampling_params": {
        "n": 3, "max_tokens": 4, "ignore_eos": True, "seed": 3}})
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 for c in data["choices"])
    assert data["usage"]["prompt_tokens"] == len(PROMPT)
    assert data["usage"]["completion_tokens"] == 12


def test_prompt_logprobs_as_prime_rl_reads_them(http: httpx.Client) -> None:
    """prime-rl's prefill scoring body: one logprob per prompt token from
    ``prompt_logprobs`` (None first), the prompt token's own entry first in each map."""
    r = http.post("/inference/v1/generate", json={
        "model": None, "token_ids": PROMPT, "sampling_params": {
            "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}})
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for pos, entry in enumerate(entries[1:], 1):
        first_id, first = next(iter(entry.items()))
        assert int(first_id) == PROMPT[pos]
        assert set(first) == {"logprob", "rank", "decoded_token"}
        assert len(entry) <= 2
    scored = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                          "logprob_start_len": 0,
                                          "sampling_params": {"max_new_tokens": 1}}).json()
    want = [e[0] for e in scored["meta_info"]["input_token_logprobs"][1:]]
    got = [next(iter(e.values()))["logprob"] for e in entries[1:]]
    assert got == pytest.approx(want, abs=1e-4)


def test_stream_deltas_add_up_to_the_whole(http: httpx.Client) -> None:
    sp = {"max_tokens": 5, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    whole = generate(http, {"token_ids": PROMPT, "sampling_params": sp})["choices"][0]
    with http.stream("POST", "/inference/v1/generate", json={
            "token_ids": PROMPT, "sampling_params": sp, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    usage = events.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert ids == whole["token_ids"]
    assert [c["logprob"] for e in events for c in e["choices"][0]["logprobs"]["content"]] == \
        pytest.approx([c["logprob"] for c in whole["logprobs"]["content"]], abs=1e-4)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"][0]["weight_versions"] == whole["weight_versions"]
    assert all(e["choices"][0]["weight_versions"] is None for e in events[:-1])


def test_stop_token_is_the_stop_reason(http: httpx.Client) -> None:
    ref = native(http, PROMPT, max_new_tokens=4, ignore_eos=True)["output_ids"]
    stop_id = ref[1]
    choice = generate(http, {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 4, "temperature": 0.0, "stop_token_ids": [stop_id]}})["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == ref[:ref.index(stop_id) + 1]


def test_cache_salt_names_its_own_prefix_namespace(http: httpx.Client) -> None:
    ids = list(range(40, 60))
    generate(http, {"token_ids": ids, "cache_salt": "tenant-a",
                    "sampling_params": {"max_tokens": 1}})

    def cached(salt: str) -> int:
        r = http.post("/generate", json={"input_ids": ids, "cache_salt": salt,
                                         "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= len(ids) - 1


def test_text_mode_adds_text(http: httpx.Client) -> None:
    data = generate(http, {"token_ids": PROMPT, "output_mode": "text", "sampling_params": {
        "max_tokens": 3, "temperature": 0.0, "logprobs": 2, "ignore_eos": True}})
    choice = data["choices"][0]
    ref = native(http, PROMPT, max_new_tokens=3, ignore_eos=True)
    assert data["output_mode"] == "text" and choice["text"] == ref["text"]
    assert all(isinstance(e["token"], str) and e["bytes"] is not None
               for e in choice["logprobs"]["content"])


@pytest.mark.parametrize("body, status, param", [
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": "many"}}, 400,
     "sampling_params.max_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {"top_p": 0.0}}, 400, "sampling_params.top_p"),
    ({"token_ids": PROMPT, "sampling_params": {"temperature": 2.5}}, 400,
     "sampling_params.temperature"),
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [-1], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": PROMPT}, 400, "sampling_params"),
    ({"token_ids": PROMPT, "sampling_params": {"logit_bias": {"3": 1.0}}}, 400,
     "sampling_params.logit_bias"),
    ({"token_ids": PROMPT, "sampling_params": {}, "priority": 5}, 400, "priority"),
    ({"token_ids": PROMPT, "sampling_params": {}, "cache_salt": ""}, 400, "cache_salt"),
    ({"token_ids": PROMPT, "sampling_params": {}, "kv_transfer_params": {}}, 400,
     "kv_transfer_params"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": CONTEXT}}, 400,
     "sampling_params.max_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {}, "model": "no-such-model"}, 404, "model"),
])
def test_bad_requests_are_vllm_errors_naming_the_field(http: httpx.Client, body: dict[str, Any],
                                                       status: int, param: str) -> None:
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status
    assert param.split(".")[-1] in error["message"]


def test_unknown_fields_are_ignored_as_vllm_does(http: httpx.Client) -> None:
    data = generate(http, {"token_ids": PROMPT, "not_a_field": 1, "sampling_params": {
        "max_tokens": 2, "also_not_a_field": True, "extra_args": {"x": 1}}})
    assert len(data["choices"][0]["token_ids"]) <= 2


def test_abort_requests_by_request_id(http: httpx.Client) -> None:
    """A queued generate request (the scheduler paused) is aborted by the request_id its
    caller gave: every sample ends with finish_reason "abort"."""
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    result: dict[str, Any] = {}

    def call() -> None:
        result["answer"] = http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "request_id": "to-abort",
            "sampling_params": {"n": 2, "max_tokens": 8}}).json()

    worker = threading.Thread(target=call)
    worker.start()
    try:
        deadline = time.time() + 30
        while http.get("/get_server_info").json()["num_waiting_reqs"] < 2:
            assert time.time() < deadline, "the request never reached the queue"
        r = http.post("/inference/v1/abort_requests", json={"request_ids": ["to-abort"]})
        assert r.status_code == 200
    finally:
        http.post("/continue_generation")
        worker.join(30)
    choices = result["answer"]["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
    missing = http.post("/inference/v1/abort_requests", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_ids"


def test_weight_version_spans_pass_through() -> None:
    """The engine's spans (the agreed ``meta_info["weight_versions"]``) are vLLM's."""
    spans = [{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 5}]
    assert weight_version_spans({"weight_versions": spans, "completion_tokens": 5}) == spans
    assert weight_version_spans({"weight_versions": ["v1", "v2"],
                                 "completion_tokens": 5}) is None
