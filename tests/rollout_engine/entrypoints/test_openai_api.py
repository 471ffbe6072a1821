"""The official ``openai`` client against /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import math

import openai
import pytest

from tests.rollout_engine.entrypoints.conftest import LiveServer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI, live_server: LiveServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [live_server.engine.config.model_path]


def test_completion_equals_engine(client: openai.OpenAI, live_server: LiveServer) -> None:
    r = client.completions.create(model="m", prompt="The sky is", max_tokens=12,
                                  temperature=0.7, seed=11)
    ref = live_server.engine.generate(prompt="The sky is", sampling_params={
        "max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 11})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_n_batch_and_logprobs(client: openai.OpenAI, live_server: LiveServer) -> None:
    r = client.completions.create(model="m", prompt=["one", "two"], max_tokens=6, n=3,
                                  temperature=1.0, seed=5, logprobs=2)
    assert [c.index for c in r.choices] == list(range(6))
    ref = live_server.engine.generate(prompt=["one", "two"], return_logprob=True,
                                      top_logprobs_num=2, sampling_params={
                                          "max_new_tokens": 6, "temperature": 1.0, "n": 3,
                                          "sampling_seed": 5})
    for choice, res in zip(r.choices, ref):
        lp = choice.logprobs
        assert choice.text == res["text"]
        assert len(lp.tokens) == len(lp.token_logprobs) == len(res["output_ids"])
        ref_lps = [x for x, _, _ in res["meta_info"]["output_token_logprobs"]]
        assert lp.token_logprobs == pytest.approx(ref_lps, abs=1e-5)
        for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(tlp)
            assert all(v <= 0 for v in top.values())
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert lp.text_offset[-1] <= len(choice.text)
        assert "".join(lp.tokens) == choice.text or any(t.startswith("bytes:")
                                                        for t in lp.tokens)
    prompt_tokens = sum(res["meta_info"]["prompt_tokens"] for res in ref[::3])
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == sum(len(res["output_ids"]) for res in ref)


def test_completion_stream_concatenates(client: openai.OpenAI) -> None:
    kw = dict(model="m", prompt="Once upon", max_tokens=16, temperature=1.0, seed=42, n=2)
    full = client.completions.create(**kw)
    texts = ["", ""]
    finish: list = [None, None]
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completion_echo_logprobs_max_tokens_0(client: openai.OpenAI,
                                               live_server: LiveServer) -> None:
    """lm-eval style scoring: the prompt's own logprobs, no generation."""
    r = client.completions.create(model="m", prompt="hello there world", max_tokens=0,
                                  echo=True, logprobs=1)
    ids = live_server.engine.tokenizer.encode("hello there world", add_special_tokens=False)
    ref = live_server.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                                      return_logprob=True, logprob_start_len=0)
    c = r.choices[0]
    assert c.text == "hello there world"
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    ref_lps = [x for x, _, _ in ref["meta_info"]["input_token_logprobs"][1:]]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(ref_lps, abs=1e-5)


def test_completion_extensions(client: openai.OpenAI, live_server: LiveServer) -> None:
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
             "min_tokens": 4}
    r = client.completions.create(model="m", prompt="abc", max_tokens=8, temperature=0.9,
                                  seed=3, extra_body=extra)
    ref = live_server.engine.generate(prompt="abc", sampling_params={
        "max_new_tokens": 8, "temperature": 0.9, "sampling_seed": 3, "top_k": 5, "min_p": 0.05,
        "repetition_penalty": 1.1, "ignore_eos": True, "min_new_tokens": 4})
    assert r.choices[0].text == ref["text"] and r.usage.completion_tokens == 8
    stop_id = ref["output_ids"][2]
    r = client.completions.create(model="m", prompt="abc", max_tokens=8, temperature=0.9,
                                  seed=3, extra_body={**extra, "min_tokens": 0,
                                                      "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 3


def test_completion_bad_input(client: openai.OpenAI) -> None:
    for kw in ({"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 10**6}, {"n": 0},
               {"logprobs": -1}, {"extra_body": {"top_k": -2}}, {"suffix": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt="hi", **kw)
        assert e.value.status_code == 400


def test_chat_equals_engine_on_template(client: openai.OpenAI, live_server: LiveServer) -> None:
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10,
                                       temperature=0.5, seed=9)
    text = live_server.engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    ref = live_server.engine.generate(prompt=text, sampling_params={
        "max_new_tokens": 10, "temperature": 0.5, "sampling_seed": 9})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]


def test_chat_n_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, n=2,
                                       temperature=1.0, seed=1, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == r.usage.completion_tokens // 2 or c.finish_reason == "stop"
        for item in content:
            assert item.logprob <= 0 and item.bytes
            assert bytes(item.bytes) == item.token.encode() or item.token.startswith("bytes:")
            assert len(item.top_logprobs) == 3
            tops = [t.logprob for t in item.top_logprobs]
            assert tops == sorted(tops, reverse=True) and item.logprob <= tops[0] + 1e-6
            assert sum(math.exp(t) for t in tops) <= 1 + 1e-5


def test_chat_stream_concatenates(client: openai.OpenAI) -> None:
    kw = dict(model="m", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=21,
              logprobs=True)
    full = client.chat.completions.create(**kw)
    text, roles, lps, finish = "", [], [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            lps += [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert lps == pytest.approx([x.logprob for x in full.choices[0].logprobs.content], abs=1e-5)


def test_chat_bad_input(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": 5}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=3.0,
                                       extra_body={"min_p": 2.0})


def test_chat_return_meta_info_carries_the_token_logprobs(live_server: LiveServer) -> None:
    """An agent session server reads ``choices[0].meta_info.output_token_logprobs`` (the token
    ids of the turn, with their logprobs) and ``completion_tokens``: SGLang's
    ``return_meta_info``; ``return_prompt_token_ids`` gives the prompt's ids."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
            "logprobs": True, "return_meta_info": True, "return_prompt_token_ids": True}
    with live_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        meta = choice["meta_info"]
        ids = [t[1] for t in meta["output_token_logprobs"]]
        assert len(ids) == meta["completion_tokens"] == r.json()["usage"]["completion_tokens"]
        ref = live_server.engine.generate(input_ids=choice["prompt_token_ids"], sampling_params={
            "max_new_tokens": 6, "temperature": 0}, return_logprob=True)
        assert ids == ref["output_ids"]
        for (lp, _, _), (want, _, _) in zip(meta["output_token_logprobs"],
                                            ref["meta_info"]["output_token_logprobs"]):
            assert math.isclose(lp, want, abs_tol=1e-5)
        plain = c.post("/v1/chat/completions", json={**body, "return_meta_info": False,
                                                     "return_prompt_token_ids": False})
        assert set(plain.json()["choices"][0]) == set(choice) - {"meta_info", "prompt_token_ids"}
        stream = c.post("/v1/chat/completions", json={**body, "stream": True})
        assert stream.status_code == 400 and "return_meta_info" in stream.text
