"""Fixtures shared by the SGLang-compatibility tests: one thread-mode engine per module (its
KV invariant checked at the end) and an in-process HTTP client over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    from rollout_engine import Engine

    eng = Engine(model_path=qwen2_path, scheduler_mode="thread", dtype="float32", device="cpu",
                 context_length=512)
    yield eng
    try:
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as c:
        yield c
