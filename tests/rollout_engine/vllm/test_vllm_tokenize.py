"""vLLM's ``/tokenize`` and ``/detokenize`` shapes, and ``/v1/models``' ``max_model_len`` (which
prime-rl reads)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.rollout_engine.engines import app_client, thread_engine

CONTEXT = 300


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=CONTEXT)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    yield from app_client(engine)


def test_tokenize_prompt(client: TestClient, engine: Any) -> None:
    tok = engine.tokenizer
    r = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True,
                                       "ignored_field": 1})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = tok.encode("hello world", add_special_tokens=True)
    assert data == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}
    plain = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False})
    assert plain.json()["tokens"] == tok.encode("hello", add_special_tokens=False)
    assert plain.json()["token_strs"] is None


def test_tokenize_chat_matches_the_chat_route(client: TestClient, engine: Any) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    chat = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 1, "return_prompt_token_ids": True})
    assert r.json()["tokens"] == chat.json()["choices"][0]["prompt_token_ids"]
    bad = client.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert bad.status_code == 400 and "continue_final_message" in bad.json()["error"]["message"]


def test_detokenize_round_trip(client: TestClient, engine: Any) -> None:
    ids = engine.tokenizer.encode("round trip text", add_special_tokens=False)
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "round trip text"}
    for tokens, status in (([10**9], 400), ([-1], 400), ("x", 400)):
        r = client.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"].split(".")[0] == "tokens"


def test_unknown_model_is_404(client: TestClient) -> None:
    r = client.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_models_card_carries_max_model_len(client: TestClient) -> None:
    """prime-rl reads ``max_model_len`` from each card of /v1/models."""
    cards = client.get("/v1/models").json()["data"]
    assert [c.get("max_model_len") for c in cards] == [CONTEXT]
