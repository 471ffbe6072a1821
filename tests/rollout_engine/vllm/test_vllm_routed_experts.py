"""Rollout routing replay on vLLM's ``/inference/v1/generate``: with
``--enable-return-routed-experts`` each choice carries ``routed_experts`` as vLLM sends it
(base64 of ``.npy`` bytes, ``[num_tokens - 1 - routed_experts_prompt_start, num_layers,
top_k]``), equal to transformers' routers; without the flag it is null."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.rollout_engine.engines import served_over_http, thread_engine
from tests.rollout_engine.hf_reference import hf_routed_experts

PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def moe_path() -> str:
    from rollout_engine.testing.tiny_moe import tiny_moe_path

    return str(tiny_moe_path("qwen3_moe"))


@pytest.fixture(scope="module")
def url(moe_path: str) -> Iterator[str]:
    for engine in thread_engine(moe_path, enable_return_routed_experts=True,
                                served_model_name="moe"):
        yield from served_over_http(engine)


def _generate(url: str, **sampling: Any) -> httpx.Response:
    return httpx.post(url + "/inference/v1/generate", timeout=60, json={
        "model": "moe", "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 5, "temperature": 0.0, **sampling}})


@pytest.mark.parametrize("start", [0, 4, len(PROMPT)])
def test_routed_experts_equal_transformers_routing(url: str, moe_path: str, start: int):
    r = _generate(url, routed_experts_prompt_start=start)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
    assert got.dtype == np.int32
    want = hf_routed_experts(moe_path, PROMPT + choice["token_ids"])[start:]
    assert got.shape == tuple(want.shape)
    assert torch.equal(torch.from_numpy(got).sort(-1).values, want.sort(-1).values)


def test_a_start_past_the_prompt_is_refused(url: str):
    r = _generate(url, routed_experts_prompt_start=len(PROMPT) + 1)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.routed_experts_prompt_start"


def test_null_when_the_server_does_not_record(moe_path: str):
    for engine in thread_engine(moe_path, served_model_name="moe"):
        for plain in served_over_http(engine):
            r = _generate(plain)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["routed_experts"] is None
