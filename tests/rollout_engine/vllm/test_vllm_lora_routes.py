"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: its bodies, its plain-text successes
and its error codes; ``load_inplace`` replaces an adapter's weights with no stale KV served."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.http_server import create_app
from tests.rollout_engine.lora.adapters import prompts
from tests.rollout_engine.lora.conftest import adapters, build_adapter, vocab  # noqa: F401

ADMIN = {"Authorization": "Bearer admin-key"}
GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture
def served(make_engine: Callable[..., Any], qwen2_path: str,
           adapters: dict[str, str]) -> Iterator[tuple[Any, TestClient]]:  # noqa: F811
    engine = make_engine(qwen2_path, enable_lora=True, max_lora_rank=8,
                         lora_target_modules=["all"], served_model_name="tiny")
    with TestClient(create_app(engine, admin_api_key="admin-key")) as client:
        yield engine, client


def _load(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)


def _generate(client: TestClient, prompt: list[int], lora: str) -> list[int]:
    r = client.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY,
                                       "lora_path": lora})
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


def test_load_serve_reload_in_place_and_unload(served, adapters, vocab):  # noqa: F811
    engine, client = served
    assert client.post("/v1/load_lora_adapter", json={
        "lora_name": "a", "lora_path": adapters["all8"]}).status_code == 401   # admin only
    r = _load(client, lora_name="a", lora_path=adapters["all8"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    prompt = prompts(vocab, [11], seed=1)[0]
    first = _generate(client, prompt, "a")
    assert first == engine.generate(input_ids=prompt, lora_path="a",
                                    sampling_params=GREEDY)["output_ids"]

    r = _load(client, lora_name="a", lora_path=adapters["linear4"])
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "The lora adapter 'a' has already been loaded. If you want to load the "
                   "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput", "param": "lora_name", "code": 400}

    r = _load(client, lora_name="a", lora_path=adapters["linear4"], load_inplace=True)
    assert r.status_code == 200, r.text
    engine.load_lora_adapter("b", adapters["linear4"])
    fresh = engine.generate(input_ids=prompt, lora_path="b", sampling_params=GREEDY)
    again = _generate(client, prompt, "a")   # the same prompt: its old-version KV not reused
    assert again == fresh["output_ids"] and again != first

    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=ADMIN)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": 1},
                    headers=ADMIN)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'a' cannot be found."


@pytest.mark.parametrize("body, status, words", [
    ({"lora_name": "a"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "", "lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path'"),
    ({"lora_name": "tiny", "lora_path": "/x"}, 400, "conflicts with a served base model"),
    ({"lora_name": "a", "lora_path": "/no/such/adapter"}, 404,
     "Loading lora a failed: No adapter found for /no/such/adapter"),
    ({"lora_name": "a", "lora_path": "/x", "rank": 4}, 400, "unknown field"),
    ({"lora_name": "a", "lora_path": "/x", "load_inplace": "yes"}, 400, "load_inplace"),
])
def test_load_errors_are_vllms(served, body, status, words):
    _, client = served
    r = _load(client, **body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == status


def test_an_adapter_the_engine_refuses_is_a_400_naming_why(served, build_adapter,  # noqa: F811
                                                           qwen2_path):
    from tests.rollout_engine.lora.adapters import AdapterSpec

    _, client = served
    too_big = build_adapter(qwen2_path, "r16", AdapterSpec(16, 16, ("q_proj",)))
    r = _load(client, lora_name="big", lora_path=too_big)
    assert r.status_code == 400 and "rank" in r.json()["error"]["message"], r.text
    r = client.post("/v1/unload_lora_adapter", json={}, headers=ADMIN)
    assert r.status_code == 400 and "'lora_name' needs to be provided" in r.text
