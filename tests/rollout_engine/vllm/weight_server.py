"""What the vLLM weight-route tests share: a live uvicorn server over its own engine (the tests
change its weights, so it is never the session's shared server), the reference outputs of a
fresh engine, and two checkpoints."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.rollout_engine.entrypoints.conftest import LiveServer, bound_socket

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def checkpoints() -> tuple[str, str]:
    """Two qwen2 checkpoints of one shape, different weights (W1, W2)."""
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@contextmanager
def live_server(model_path: str, **flags: Any) -> Iterator[LiveServer]:
    """A uvicorn server in a thread over a fresh engine on ``model_path`` (thread scheduler)."""
    import uvicorn

    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    flags = {"dtype": "float32", "device": "cpu", "scheduler_mode": "thread",
             "context_length": 512, **flags}
    engine = Engine(model_path=model_path, **flags)
    app = create_app(engine)
    sock = bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def greedy(server: LiveServer) -> list[list[int]]:
    """Greedy output ids of ``PROMPTS`` through the server's /generate."""
    with server.client() as c:
        out = []
        for ids in PROMPTS:
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            out.append(r.json()["output_ids"])
        return out


def fresh_greedy(model_path: str) -> list[list[int]]:
    """The same outputs from a fresh engine on ``model_path``."""
    from rollout_engine import Engine

    engine = Engine(model_path=model_path, dtype="float32", device="cpu",
                    scheduler_mode="thread", context_length=512)
    try:
        return [engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
                for ids in PROMPTS]
    finally:
        engine.shutdown()
