"""A live rollout server for the HTTP tests: one Engine (scheduler in a child process) served by
uvicorn in a thread on a free port, shared by every test of this package."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

CONTEXT_LEN = 512   # keeps the worst valid request a fuzzer can draw cheap


@dataclass
class LiveServer:
    url: str
    engine: Any
    app: Any

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll until the scheduler has nothing running or waiting; return the server info."""
        deadline = time.time() + timeout
        with self.client() as c:
            while True:
                info = c.get("/get_server_info").json()
                if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                    return info
                if time.time() > deadline:
                    raise AssertionError(f"server not idle after {timeout} s: {info}")
                time.sleep(0.05)

    def assert_no_leak(self) -> dict[str, Any]:
        """Idle, the KV invariant holds and every slot is free or cached."""
        self.wait_idle()
        with self.client() as c:
            r = c.get("/check_integrity")
        assert r.status_code == 200, r.text
        report = r.json()["result"]
        assert report["idle"] and report["owned_tokens"] == 0
        assert report["free_tokens"] + report["cached_tokens"] == report["total_tokens"]
        return report


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="session")
def serve_app() -> Iterator[Any]:
    """``serve_app(app) -> url``: run an ASGI app with uvicorn in a thread until the session
    ends."""
    import uvicorn

    running: list[tuple[Any, threading.Thread]] = []

    def serve(app: Any) -> str:
        sock = bound_socket()
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        running.append((server, thread))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield serve
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def live_server(tiny_paths: dict[str, str], serve_app: Any) -> Iterator[LiveServer]:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    context_length=CONTEXT_LEN, scheduler_mode="process")
    app = create_app(engine)
    try:
        yield LiveServer(serve_app(app), engine, app)
    finally:
        engine.shutdown()
