"""Streaming as SGLang streams (python/sglang/srt/managers/tokenizer_manager_components/
output_processor.py + logprob_ops.py): by default every chunk of /generate and of
Engine.generate(stream=True) carries the whole text, output_ids and output logprobs so far;
with incremental_streaming_output only what is new (output logprob lists sliced the same way).
Prompt logprobs ride along in every chunk once known. The OpenAI routes stream deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

PROMPT = "Once upon a time there was"
SEEDED = {"max_new_tokens": 32, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}


def _engine(path: str, **flags: Any) -> Any:
    from rollout_engine import Engine

    return Engine(model_path=path, scheduler_mode="thread", dtype="float32", device="cpu",
                  context_length=512, **flags)


@pytest.fixture(scope="module")
def cumulative(qwen2_path: str) -> Iterator[Any]:
    eng = _engine(qwen2_path)
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.fixture(scope="module")
def incremental(qwen2_path: str) -> Iterator[Any]:
    eng = _engine(qwen2_path, incremental_streaming_output=True)
    yield eng
    eng.check_integrity()
    eng.shutdown()


def _client(engine: Any) -> TestClient:
    from rollout_engine.entrypoints.http_server import create_app

    return TestClient(create_app(engine))


def _sse(r: Any) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _ids(entries: list[list[Any]]) -> list[int]:
    return [tid for _, tid, _ in entries]


def _check_cumulative(chunks: list[dict[str, Any]], whole: dict[str, Any]) -> None:
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert len(b["output_ids"]) > len(a["output_ids"])
    prompt_lps = whole["meta_info"]["input_token_logprobs"]
    for ch in chunks:
        meta = ch["meta_info"]
        assert _ids(meta["output_token_logprobs"]) == ch["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(ch["output_ids"])
        assert _ids(meta["input_token_logprobs"]) == _ids(prompt_lps)   # in every chunk
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])


def _check_incremental(chunks: list[dict[str, Any]], whole: dict[str, Any]) -> None:
    assert len(chunks) > 1
    assert "".join(ch["text"] for ch in chunks) == whole["text"]
    assert [t for ch in chunks for t in ch["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["output_ids"] != whole["output_ids"]   # not the whole sequence
    prompt_ids = _ids(whole["meta_info"]["input_token_logprobs"])
    for ch in chunks:
        meta = ch["meta_info"]
        assert _ids(meta["output_token_logprobs"]) == ch["output_ids"]   # sliced alike
        assert len(meta["output_top_logprobs"]) == len(ch["output_ids"])
        assert _ids(meta["input_token_logprobs"]) == prompt_ids
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


# -- Engine.generate(stream=True) ---------------------------------------------------------------
def test_engine_stream_is_cumulative_by_default(cumulative: Any) -> None:
    whole = cumulative.generate(PROMPT, SEEDED, **LOGPROBS)
    _check_cumulative(list(cumulative.generate(PROMPT, SEEDED, stream=True, **LOGPROBS)), whole)

    async def run() -> list[dict[str, Any]]:
        stream = await cumulative.async_generate(PROMPT, SEEDED, stream=True, **LOGPROBS)
        return [c async for c in stream]

    import asyncio

    _check_cumulative(asyncio.run(run()), whole)


def test_engine_stream_incremental_with_the_flag(incremental: Any) -> None:
    whole = incremental.generate(PROMPT, SEEDED, **LOGPROBS)
    _check_incremental(list(incremental.generate(PROMPT, SEEDED, stream=True, **LOGPROBS)),
                       whole)


def test_stream_text_in_logprobs(cumulative: Any) -> None:
    chunks = list(cumulative.generate(PROMPT, SEEDED, stream=True, return_logprob=True,
                                      return_text_in_logprobs=True))
    decode = cumulative.tokenizer.decode
    for ch in chunks:
        entries = ch["meta_info"]["output_token_logprobs"]
        assert _ids(entries) == ch["output_ids"]
        assert all(text == decode([t], skip_special_tokens=False) for _, t, text in entries)


# -- /generate ----------------------------------------------------------------------------------
def test_http_stream_cumulative_and_incremental(cumulative: Any, incremental: Any) -> None:
    body = {"text": PROMPT, "sampling_params": SEEDED, **LOGPROBS}
    for engine, check in ((cumulative, _check_cumulative), (incremental, _check_incremental)):
        with _client(engine) as c:
            whole = c.post("/generate", json=body).json()
            check(_sse(c.post("/generate", json={**body, "stream": True})), whole)


def test_http_batch_stream_is_cumulative_per_index(cumulative: Any) -> None:
    body = {"text": [PROMPT, "In a land far away"], "sampling_params": {**SEEDED, "n": 2},
            **LOGPROBS}
    with _client(cumulative) as c:
        whole = c.post("/generate", json=body).json()
        chunks = _sse(c.post("/generate", json={**body, "stream": True}))
    by_index: dict[int, list[dict[str, Any]]] = {}
    for ch in chunks:
        by_index.setdefault(ch.pop("index"), []).append(ch)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, res in enumerate(whole):
        _check_cumulative(by_index[i], res)


# -- OpenAI routes keep OpenAI's deltas ---------------------------------------------------------
def test_openai_streams_deltas_on_a_cumulative_engine(cumulative: Any) -> None:
    common = {"max_tokens": 16, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    with _client(cumulative) as c:
        whole = c.post("/v1/completions", json={"prompt": PROMPT, **common}).json()
        chunks = _sse(c.post("/v1/completions", json={"prompt": PROMPT, **common,
                                                      "stream": True}))
        texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
        assert "".join(texts) == whole["choices"][0]["text"]
        assert len([t for t in texts if t]) > 1
        assert texts[-1] != whole["choices"][0]["text"]

        messages = [{"role": "user", "content": PROMPT}]
        whole = c.post("/v1/chat/completions", json={"messages": messages, **common}).json()
        chunks = _sse(c.post("/v1/chat/completions", json={"messages": messages, **common,
                                                           "stream": True}))
        deltas = [ch["choices"][0]["delta"].get("content", "") for ch in chunks]
        assert "".join(deltas) == whole["choices"][0]["message"]["content"]
        assert len([d for d in deltas if d]) > 1
