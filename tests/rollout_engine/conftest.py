"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.rollout_engine.engines import thread_engine


@pytest.fixture(scope="module")
def qwen2_engine(qwen2_path: str) -> Iterator[Any]:
    """One thread-scheduler engine on the tiny qwen2 per module; integrity checked at the end."""
    yield from thread_engine(qwen2_path)
