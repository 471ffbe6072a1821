"""Fixtures shared by the SGLang-compatibility tests: one thread-mode engine per module (its
KV invariant checked at the end) and an in-process HTTP client over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.rollout_engine.engines import app_client, thread_engine


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    yield from app_client(engine)
