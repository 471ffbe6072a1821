"""Property-based fuzzing of request bodies against the live server: whatever a client sends,
the answer is never a 5xx, error bodies are JSON, and the server stays healthy and leak-free."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rollout_engine.entrypoints.conftest import LiveServer

SETTINGS = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

# Integers from the edges (0, -1, huge) and a small range: a valid request stays cheap.
ints = st.one_of(st.integers(-3, 12), st.sampled_from([2**31, 2**63, -(2**63), 10**30, 600]))
scalars = st.one_of(st.none(), st.booleans(), ints,
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.sampled_from(["", "\ud800", "<|im_end|>", "\x00"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


SAMPLING = {
    "max_new_tokens": ints, "min_new_tokens": ints, "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": ints,
    "min_p": st.floats(-0.5, 1.5), "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(ints, max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(), "sampling_seed": ints,
}
token_ids = st.lists(st.integers(-2, 520), max_size=20)
prompts = st.text(max_size=40) | st.lists(st.text(max_size=20), max_size=3)


# null there means the 128-token default: valid, but slow enough on 2 cores to dominate the run
LENGTH_KEYS = {"max_new_tokens", "max_tokens", "sampling_params"}


def with_random_fields(base: st.SearchStrategy, names: list[str]) -> st.SearchStrategy:
    """Plausible bodies with zero to two fields replaced by arbitrary JSON values."""
    def corrupt(name: str) -> st.SearchStrategy:
        values = json_values.filter(lambda v: v is not None) if name in LENGTH_KEYS \
            else json_values
        return st.tuples(st.just(name), values)

    return st.tuples(base, st.lists(st.sampled_from(names).flatmap(corrupt), max_size=2)).map(
        lambda t: {**t[0], **dict(t[1])})


# max_new_tokens is always drawn (small or out of range), so valid requests stay short
sampling_params = with_random_fields(st.fixed_dictionaries(
    {"max_new_tokens": SAMPLING["max_new_tokens"]},
    optional={k: v for k, v in SAMPLING.items() if k != "max_new_tokens"}), list(SAMPLING))
GENERATE_FIELDS = {
    "return_logprob": st.booleans(),
    "top_logprobs_num": ints, "logprob_start_len": ints, "stream": st.booleans(),
    "rid": st.text(max_size=6), "return_text_in_logprobs": st.booleans(),
    "extra_key": st.text(max_size=6),
}
GENERATE = with_random_fields(st.one_of(
    st.fixed_dictionaries({"text": prompts, "sampling_params": sampling_params},
                          optional=GENERATE_FIELDS),
    st.fixed_dictionaries({"input_ids": token_ids | st.lists(token_ids, max_size=3),
                           "sampling_params": sampling_params}, optional=GENERATE_FIELDS)),
    ["text", "input_ids", "sampling_params", *GENERATE_FIELDS])
COMPLETION_FIELDS = {
    "model": st.text(max_size=5), "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "logprobs": ints,
    "echo": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.text(max_size=3), "seed": ints, "top_k": ints, "min_p": st.floats(-0.5, 1.5),
    "stop_token_ids": st.lists(ints, max_size=2), "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(-1, 3), "best_of": ints,
    "logit_bias": st.dictionaries(st.text(max_size=3), ints, max_size=2),
    "user": st.text(max_size=5),
}
COMPLETIONS = with_random_fields(
    st.fixed_dictionaries({"prompt": prompts | token_ids, "max_tokens": ints},
                          optional=COMPLETION_FIELDS),
    ["prompt", "max_tokens", *COMPLETION_FIELDS])


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in r.text
    else:
        r.json()


@pytest.fixture(scope="module")
def http(live_server: LiveServer):
    with live_server.client(timeout=60.0) as c:
        yield c
        assert c.get("/health").status_code == 200
    live_server.assert_no_leak()


@SETTINGS
@given(body=GENERATE)
def test_fuzz_generate(http: httpx.Client, body: dict) -> None:
    _check(http.post("/generate", content=json.dumps(body),
                     headers={"content-type": "application/json"}))


@SETTINGS
@given(body=COMPLETIONS)
def test_fuzz_completions(http: httpx.Client, body: dict) -> None:
    _check(http.post("/v1/completions", content=json.dumps(body),
                     headers={"content-type": "application/json"}))


@SETTINGS
@given(raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions",
                             "/abort_request"]),
       ctype=st.sampled_from(["application/json", "text/plain", "", "application/x+json"]))
def test_fuzz_raw_bodies(http: httpx.Client, raw: bytes, path: str, ctype: str) -> None:
    headers = {"content-type": ctype} if ctype else {}
    _check(http.post(path, content=raw, headers=headers))
