"""``/inference/v1/generate`` with ``model`` naming a loaded LoRA adapter runs on it, as vLLM
does; the served name runs on the base model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.http_server import create_app
from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.lora.adapters import SPECS, make_adapter

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [21, 22, 23, 24, 25, 26, 27]


@pytest.fixture(scope="module")
def served(qwen2_path: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Any, TestClient]]:
    adapter = make_adapter(qwen2_path, str(tmp_path_factory.mktemp("lora")), SPECS["all8"])
    for engine in thread_engine(qwen2_path, enable_lora=True, max_lora_rank=8,
                                lora_target_modules=["all"], served_model_name="tiny"):
        loaded = engine.load_lora_adapter("a", adapter)
        assert loaded["success"], loaded
        with TestClient(create_app(engine)) as client:
            yield engine, client


def _tokens(client: TestClient, model: str) -> list[int]:
    r = client.post("/inference/v1/generate", json={
        "model": model, "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_model_names_the_adapter(served: tuple[Any, TestClient]) -> None:
    engine, client = served
    lora = engine.generate(input_ids=PROMPT, lora_path="a", sampling_params=GREEDY)
    base = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert lora["output_ids"] != base["output_ids"]
    assert _tokens(client, "a") == lora["output_ids"]
    assert _tokens(client, "tiny") == base["output_ids"]
    r = client.post("/inference/v1/generate", json={"model": "b", "token_ids": PROMPT,
                                                    "sampling_params": {}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
