"""The requests TRL 1.16's ``VLLMClient`` sends, replayed as it sends them (no TRL install): the
vLLM extensions of the OpenAI routes it relies on (``return_token_ids``,
``return_tokens_as_token_ids``, ``structured_outputs``, ``top_k = 0``) and their refusals, and
``/server_info``'s ``vllm_config``. test_trl_client.py runs the client itself."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.rollout_engine.engines import app_client, thread_engine

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    # compact JSON: a random model given any whitespace emits it forever under greedy decoding
    yield from thread_engine(qwen2_path, context_length=512,
                             constrained_json_disable_any_whitespace=True)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:
    yield from app_client(engine)


def completions_body(prompts: Any, **sampling: Any) -> dict[str, Any]:
    """``VLLMClient.generate``'s body: its sampling defaults, then the caller's fields."""
    params = {"n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
              "min_p": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, **sampling}
    return {"model": "m", "prompt": prompts, "return_token_ids": True,
            "return_tokens_as_token_ids": True, **params}


def chat_body(messages: list[dict[str, Any]], **sampling: Any) -> dict[str, Any]:
    """``VLLMClient.chat``'s body for one conversation."""
    return {"model": "m", "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "min_p": 0.0, "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "messages": messages, **sampling}


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def test_completions_token_ids_and_id_named_logprobs(client: Any, engine: Any) -> None:
    choices = []
    for prompts in (["Hello there", "Once"], [[5, 6, 7]]):   # texts, or token ids
        r = client.post("/v1/completions", json=completions_body(prompts, n=2, temperature=0.0,
                                                                 logprobs=2))
        assert r.status_code == 200, r.text
        choices += r.json()["choices"]
    assert len(choices) == 6   # prompt-major: the n samples of a prompt together
    assert [c["prompt_token_ids"] for c in choices] == [
        *[engine.tokenizer.encode("Hello there")] * 2, *[engine.tokenizer.encode("Once")] * 2,
        [5, 6, 7], [5, 6, 7]]
    for choice in choices:
        ref = engine.generate(input_ids=choice["prompt_token_ids"], return_logprob=True,
                              top_logprobs_num=2, sampling_params={"temperature": 0,
                                                                   "max_new_tokens": MAX_TOKENS})
        assert choice["token_ids"] == ref["output_ids"]
        lp = choice["logprobs"]
        assert [token_id(t) for t in lp["tokens"]] == choice["token_ids"]
        assert lp["token_logprobs"] == pytest.approx(
            [v for v, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
        for top, ref_top in zip(lp["top_logprobs"], ref["meta_info"]["output_top_logprobs"],
                                strict=True):
            assert {token_id(t) for t in top} >= {t for _, t, _ in ref_top}


def test_chat_token_ids(client: Any, engine: Any) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    r = client.post("/v1/chat/completions", json=chat_body(messages, n=2, temperature=0.0))
    assert r.status_code == 200, r.text
    out = r.json()
    prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
    assert out["prompt_token_ids"] == prompt_ids
    ref = engine.generate(input_ids=prompt_ids, sampling_params={"temperature": 0,
                                                                 "max_new_tokens": MAX_TOKENS})
    for choice in out["choices"]:
        assert choice["token_ids"] == ref["output_ids"]
        content = choice["logprobs"]["content"]
        assert [token_id(e["token"]) for e in content] == ref["output_ids"]


def test_top_k_below_minus_one_is_refused(client: Any) -> None:
    r = client.post("/v1/completions", json=completions_body(["x"], top_k=-2))
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("spec", "pattern"), [
    ({"regex": "[0-9]{3}"}, "[0-9]{3}"),          # what structured_outputs_regex sends
    ({"choice": ["yes", "no"]}, "yes|no"),
    ({"grammar": 'root ::= "a" [b-c]'}, "a[bc]"),
])
def test_structured_outputs(client: Any, route: str, spec: dict[str, Any],
                            pattern: str) -> None:
    prompt = ({"prompt": "Answer:"} if route == "/v1/completions"
              else {"messages": [{"role": "user", "content": "Answer:"}]})
    r = client.post(route, json={"model": "m", **prompt, "max_tokens": 8, "temperature": 1.0,
                                 "structured_outputs": spec})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert re.fullmatch(pattern, text), text


def test_structured_outputs_json(client: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.post("/v1/completions", json={"model": "m", "prompt": "{", "max_tokens": 32,
                                             "temperature": 0,
                                             "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"])["n"], int)


@pytest.mark.parametrize(("extra", "named"), [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "regex and choice"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "regex": "b"}, "regex"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
])
def test_structured_outputs_refusals_name_the_key(client: Any, extra: dict[str, Any],
                                                  named: str) -> None:
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", **extra})
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


def test_top_k_zero_is_no_truncation(client: Any, engine: Any) -> None:
    body = completions_body(["abc"], temperature=0.9, seed=5, top_k=0)
    got = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    ref = engine.generate(prompt="abc", sampling_params={
        "temperature": 0.9, "sampling_seed": 5, "top_k": -1, "max_new_tokens": MAX_TOKENS})
    assert got == ref["output_ids"]


def test_server_info_vllm_config(client: Any) -> None:
    info = client.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    assert info["vllm_config"]["parallel_config"]["world_size_across_dp"] == 1
    assert client.get("/server_info", params={"config_format": "x"}).status_code == 400
