"""What one request may cost the server: a chat template sent with a request is refused unless
the server trusts request templates, every render is bounded in time (and runs on threads of its
own, so plain /generate keeps going), and top logprobs and stop conditions are capped (400 naming
the cap and its flag; a value at the cap is served)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints.serving import TEMPLATE_THREADS, TOKENIZE_THREADS
from tests.rollout_engine.entrypoints.conftest import CONTEXT_LEN, LiveServer

MESSAGES = [{"role": "user", "content": "hi"}]
INJECTED = "INJECTED {{ messages[0]['content'] }}"
RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RENDER_S = 0.5
CAPS = {"max_top_logprobs_num": 3, "max_stop_strings": 2, "max_stop_str_len": 8,
        "max_stop_token_ids": 2}


@pytest.fixture(scope="module")
def trusting(tiny_paths: dict[str, str], serve_app: Any) -> Iterator[LiveServer]:
    """A server that renders request templates, with a short render bound and small caps."""
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    context_length=CONTEXT_LEN, scheduler_mode="thread",
                    trust_request_chat_template=True, max_template_render_s=RENDER_S, **CAPS)
    app = create_app(engine)
    try:
        yield LiveServer(serve_app(app), engine, app)
    finally:
        engine.shutdown()


def _chat(server: LiveServer, timeout: float = 60.0, **body: Any) -> httpx.Response:
    with server.client(timeout=timeout) as c:
        return c.post("/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 1, **body})


def _generate(server: LiveServer, **body: Any) -> httpx.Response:
    sampling = {"max_new_tokens": 2, **body.pop("sampling_params", {})}
    with server.client() as c:
        return c.post("/generate", json={"text": "hi", "sampling_params": sampling, **body})


def _prompt_len(server: LiveServer, text: str) -> int:
    return len(server.engine.tokenizer.encode(text, add_special_tokens=False))


def _refused(r: httpx.Response, *names: str) -> None:
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for name in names:
        assert name in message, message


# -- chat templates ----------------------------------------------------------------------------
def test_a_request_template_is_refused_and_the_servers_own_is_used(
        live_server: LiveServer) -> None:
    _refused(_chat(live_server, chat_template_kwargs={"chat_template": INJECTED}),
             "chat_template_kwargs.chat_template:", "--trust-request-chat-template")
    _refused(_chat(live_server, chat_template=INJECTED),
             "chat_template:", "--trust-request-chat-template")
    r = _chat(live_server, chat_template_kwargs={"flavour": "salty"})
    assert r.status_code == 200, r.text
    own = live_server.engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == _prompt_len(live_server, own)


def test_a_trusting_server_renders_the_request_template(trusting: LiveServer) -> None:
    expected = _prompt_len(trusting, "INJECTED hi")
    for body in ({"chat_template_kwargs": {"chat_template": INJECTED}},
                 {"chat_template": INJECTED}):
        r = _chat(trusting, **body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == expected
    _refused(_chat(trusting, chat_template=INJECTED,
                   chat_template_kwargs={"chat_template": INJECTED}), "give one")


def test_a_runaway_template_is_refused_within_the_bound_while_generate_runs(
        trusting: LiveServer) -> None:
    """More runaway renders than there are tokenizer threads, and a plain /generate beside
    them: each render is refused once the bound passes; /generate is served meanwhile."""
    num_chats = TOKENIZE_THREADS + TEMPLATE_THREADS
    start = threading.Barrier(num_chats + 1)
    results: dict[str, Any] = {}

    def chat(i: int) -> None:
        start.wait()
        t0 = time.monotonic()
        results[f"chat{i}"] = (_chat(trusting, timeout=30.0, chat_template=RUNAWAY),
                               time.monotonic() - t0)

    def generate() -> None:
        start.wait()
        t0 = time.monotonic()
        results["generate"] = (_generate(trusting), time.monotonic() - t0)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(num_chats)]
    threads.append(threading.Thread(target=generate))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    generated, _ = results.pop("generate")
    assert generated.status_code == 200, generated.text
    assert len(results) == num_chats
    waves = -(-num_chats // TEMPLATE_THREADS)   # renders queue on the template threads
    for r, elapsed in results.values():
        _refused(r, f"longer than {RENDER_S:g} s", "--max-template-render-s")
        assert elapsed < waves * RENDER_S + 5.0, elapsed


def test_template_renders_never_hold_the_tokenizer_threads(trusting: LiveServer) -> None:
    service = trusting.app.state.service
    release = threading.Event()

    async def run() -> list[int]:
        blocked = [asyncio.ensure_future(service.offload_template(release.wait, 30))
                   for _ in range(TEMPLATE_THREADS + 1)]
        try:   # every template thread waits; tokenizing is served all the same
            return await asyncio.wait_for(service.offload(trusting.engine.tokenizer.encode,
                                                          "hi there"), timeout=10)
        finally:
            release.set()
            await asyncio.gather(*blocked)

    assert asyncio.run(run()) == trusting.engine.tokenizer.encode("hi there")


# -- caps ----------------------------------------------------------------------------------------
def test_default_caps_on_generate(live_server: LiveServer) -> None:
    assert _generate(live_server, return_logprob=True, top_logprobs_num=20).status_code == 200
    _refused(_generate(live_server, return_logprob=True, top_logprobs_num=21),
             "top_logprobs_num:", "at most 20", "--max-top-logprobs-num")
    stops = [f"<stop{i}>" for i in range(64)]
    assert _generate(live_server, sampling_params={"stop": stops}).status_code == 200
    _refused(_generate(live_server, sampling_params={"stop": [*stops, "<one more>"]}),
             "sampling_params.stop:", "at most 64", "--max-stop-strings")
    assert _generate(live_server, sampling_params={"stop": ["x" * 256]}).status_code == 200
    _refused(_generate(live_server, sampling_params={"stop": ["x" * 257]}),
             "sampling_params.stop:", "at most 256", "--max-stop-str-len")
    ids = [7] * 1024
    assert _generate(live_server, sampling_params={"stop_token_ids": ids}).status_code == 200
    _refused(_generate(live_server, sampling_params={"stop_token_ids": [*ids, 7]}),
             "sampling_params.stop_token_ids:", "at most 1024", "--max-stop-token-ids")


def test_default_caps_on_the_openai_routes(live_server: LiveServer) -> None:
    with live_server.client() as c:
        def complete(**body: Any) -> httpx.Response:
            return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})

        assert complete(logprobs=20).status_code == 200
        _refused(complete(logprobs=21), "logprobs:", "at most 20", "--max-top-logprobs-num")
        _refused(complete(stop=[str(i) for i in range(65)]), "stop:", "--max-stop-strings")
        _refused(complete(stop_token_ids=[7] * 1025), "stop_token_ids:", "--max-stop-token-ids")
    assert _chat(live_server, logprobs=True, top_logprobs=20).status_code == 200
    _refused(_chat(live_server, logprobs=True, top_logprobs=21),
             "top_logprobs:", "at most 20", "--max-top-logprobs-num")
    _refused(_chat(live_server, stop="x" * 257), "stop:", "--max-stop-str-len")


def test_configured_caps(trusting: LiveServer) -> None:
    assert _generate(trusting, return_logprob=True, top_logprobs_num=3).status_code == 200
    _refused(_generate(trusting, return_logprob=True, top_logprobs_num=4), "at most 3")
    assert _generate(trusting, sampling_params={"stop": ["a" * 8, "b"],
                                                "stop_token_ids": [7, 8]}).status_code == 200
    _refused(_generate(trusting, sampling_params={"stop": ["a", "b", "c"]}), "at most 2")
    _refused(_generate(trusting, sampling_params={"stop": "a" * 9}), "at most 8")
    _refused(_generate(trusting, sampling_params={"stop_token_ids": [7, 8, 9]}), "at most 2")
    engine = trusting.engine
    with pytest.raises(ValueError, match="--max-stop-strings"):
        engine.generate(prompt="hi", sampling_params={"stop": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="--max-top-logprobs-num"):
        engine.generate(prompt="hi", return_logprob=True, top_logprobs_num=4)


@pytest.mark.parametrize("field, value", [
    ("max_top_logprobs_num", -1), ("max_stop_strings", -1), ("max_stop_str_len", 0),
    ("max_stop_token_ids", -1), ("max_template_render_s", 0.0),
])
def test_cap_flags_are_validated(qwen2_path: str, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^EngineConfig.{field}: "):
        EngineConfig(model_path=qwen2_path, **{field: value})
