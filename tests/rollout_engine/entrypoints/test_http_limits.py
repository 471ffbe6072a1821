"""HTTP resource limits: body size (413, enforced while reading; larger for refits),
tokenization off the event loop, a bounded number of requests in flight (503), and a warning
when the server is exposed without an API key."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_engine.entrypoints import http_server
from rollout_engine.entrypoints.launch_server import parse_args
from rollout_engine.tokenizer_manager import EngineOverloadedError
from tests.rollout_engine.entrypoints.conftest import CONTEXT_LEN, LiveServer

BODY_LIMIT = 4096
REFIT_LIMIT = 65536
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def limited(tiny_paths: dict[str, str], serve_app: Any) -> Iterator[LiveServer]:
    from rollout_engine import Engine

    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    context_length=CONTEXT_LEN, scheduler_mode="thread",
                    max_request_body_bytes=BODY_LIMIT, max_refit_body_bytes=REFIT_LIMIT,
                    max_queued_requests=MAX_QUEUED)
    app = http_server.create_app(engine)
    try:
        yield LiveServer(serve_app(app), engine, app)
    finally:
        engine.shutdown()


# -- body size ---------------------------------------------------------------------------------
def test_a_body_over_the_limit_gets_a_413_json_error(limited: LiveServer) -> None:
    with limited.client() as c:
        r = c.post("/generate", json={"text": "x" * BODY_LIMIT})
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert str(BODY_LIMIT) in message and "--max-request-body-bytes" in message


def test_a_body_without_a_length_is_refused_while_it_is_read(limited: LiveServer) -> None:
    """A chunked body with no Content-Length is cut off once it passes the limit, not
    buffered first (the stream below never ends)."""
    pulled = 0

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        if pulled > 1000:
            raise AssertionError("the server buffered a 1 MB body past a 4 KB limit")
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/generate", "raw_path": b"/generate",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 1),
             "client": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")]}
    asyncio.run(limited.app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert pulled <= BODY_LIMIT // 1024 + 1


def test_the_refit_route_takes_larger_bodies(limited: LiveServer) -> None:
    between = {"serialized_named_tensors": ["A" * (2 * BODY_LIMIT)]}
    with limited.client() as c:
        r = c.post("/update_weights_from_tensor", json=between)
        assert r.status_code == 400, r.text   # read and refused as a bad payload, not as big
        big = c.post("/update_weights_from_tensor",
                     json={"serialized_named_tensors": ["A" * REFIT_LIMIT]})
        assert big.status_code == 413, big.text
        assert "--max-refit-body-bytes" in big.json()["error"]["message"]
    assert limited.engine.get_server_info()["weights_stale"] is False


# -- tokenization off the event loop -----------------------------------------------------------
def test_a_slow_tokenization_does_not_stall_other_requests(limited: LiveServer,
                                                           monkeypatch: Any) -> None:
    """While one request's prompt is being tokenized (held here until released), another
    request is served from start to finish."""
    builder = limited.engine.tm.builder
    build = builder.build
    entered, release = threading.Event(), threading.Event()

    def slow_build(prompt: Any = None, *args: Any, **kwargs: Any) -> Any:
        if prompt == "BLOCK":
            entered.set()
            assert release.wait(120)
        return build(prompt, *args, **kwargs)

    monkeypatch.setattr(builder, "build", slow_build)
    params = {"max_new_tokens": 2, "temperature": 0.0}
    results: dict[str, httpx.Response] = {}

    def blocked() -> None:
        with limited.client(timeout=120) as c:
            results["blocked"] = c.post("/generate", json={"text": "BLOCK",
                                                           "sampling_params": params})

    thread = threading.Thread(target=blocked)
    thread.start()
    try:
        assert entered.wait(60)
        with limited.client(timeout=30) as c:
            other = c.post("/generate", json={"text": "hello", "sampling_params": params})
        assert other.status_code == 200, other.text
        assert "blocked" not in results   # served while the slow one was still tokenizing
    finally:
        release.set()
        thread.join(120)
    assert results["blocked"].status_code == 200, results["blocked"].text


# -- requests in flight ------------------------------------------------------------------------
def test_a_full_engine_refuses_new_requests_with_503(limited: LiveServer) -> None:
    engine = limited.engine
    engine.pause_generation("in_place")   # queued requests wait: they stay in flight
    streams = []
    try:
        for i in range(MAX_QUEUED):
            streams.append(engine.generate("hello", {"max_new_tokens": 4}, stream=True,
                                           rid=f"full-{i}"))
        with limited.client() as c:
            r = c.post("/generate", json={"text": "hello", "sampling_params": {
                "max_new_tokens": 4}})
        assert r.status_code == 503, r.text
        assert f"max_queued_requests={MAX_QUEUED}" in r.json()["error"]["message"]
        assert r.headers.get("retry-after") == "1"
        with pytest.raises(EngineOverloadedError, match="max_queued_requests"):
            engine.generate("hello", {"max_new_tokens": 4})
    finally:
        engine.continue_generation()
        states = [s.st for s in streams]
        for s in streams:
            s.close()
        for st in states:
            engine.tm.wait(st, timeout=60)
    with limited.client() as c:   # room again once they are gone
        r = c.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    limited.assert_no_leak()


def test_the_limits_are_server_flags(tiny_paths: dict[str, str]) -> None:
    kwargs = parse_args(["--model-path", tiny_paths["qwen2"], "--max-queued-requests", "8",
                         "--max-request-body-bytes", "1000", "--max-refit-body-bytes", "9000"])
    assert kwargs["max_queued_requests"] == 8
    assert kwargs["max_request_body_bytes"] == 1000 and kwargs["max_refit_body_bytes"] == 9000


# -- exposure ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host,api_key,warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True),
    ("example.internal", None, True), ("127.0.0.1", None, False), ("localhost", None, False),
    ("::1", None, False), ("0.0.0.0", "secret", False)])
def test_binding_a_reachable_address_without_a_key_warns(monkeypatch: Any, caplog: Any,
                                                         host: str, api_key: Any,
                                                         warns: bool) -> None:
    class Stop(Exception):
        pass

    def no_engine(**kwargs: Any) -> Any:
        raise Stop   # the warning comes before the engine is built

    monkeypatch.setattr(http_server, "Engine", no_engine)
    with caplog.at_level(logging.WARNING, logger=http_server.logger.name):
        with pytest.raises(Stop):
            http_server.run_server({"model_path": "unused", "host": host, "api_key": api_key})
    warned = [r for r in caplog.records if "without an API key" in r.getMessage()]
    assert bool(warned) is warns, [r.getMessage() for r in caplog.records]
