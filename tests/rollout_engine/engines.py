"""Engine and HTTP-client setups shared by several test modules' fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def thread_engine(model_path: str, **flags: Any) -> Iterator[Any]:
    """A thread-scheduler float32 CPU engine on ``model_path``; when the fixture using it is
    torn down, the KV integrity is checked and the engine shut down (``yield from`` it)."""
    from rollout_engine import Engine

    eng = Engine(model_path=model_path, scheduler_mode="thread", dtype="float32", device="cpu",
                 **flags)
    yield eng
    try:
        eng.check_integrity()
    finally:
        eng.shutdown()


def app_client(engine: Any) -> Iterator[Any]:
    """A Starlette TestClient over the HTTP app of ``engine`` (``yield from`` it)."""
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as c:
        yield c
