"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def qwen2_engine(qwen2_path: str) -> Iterator[Any]:
    """One thread-scheduler engine on the tiny qwen2 per module; integrity checked at the end."""
    from rollout_engine import Engine

    eng = Engine(model_path=qwen2_path, scheduler_mode="thread", dtype="float32", device="cpu")
    yield eng
    try:
        eng.check_integrity()
    finally:
        eng.shutdown()
