"""The real vllm-router (pip ``vllm-router``: a Rust binary) in front of two of our servers
started by ``rollout-engine vllm-serve``: OpenAI completions and chat completions, whole and
streamed, are forwarded and answered, round-robin over both servers.

The router re-serializes a chat body with fields of its own (``include_reasoning``,
``separate_reasoning``, ...), so this also checks that our chat request accepts them. It lives in
a separate virtual environment built once per cache directory (``tests/venvs.py``)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.rollout_engine.vllm.serve_process import free_port, stop, vllm_serve, wait_healthy
from tests.venvs import client_venv

ROUTER_PACKAGES = ["vllm-router==0.1.17"]

pytestmark = pytest.mark.slow   # two servers in child processes and a router: about a minute


@pytest.fixture(scope="module")
def servers(tiny_paths: dict[str, str]) -> Iterator[list[str]]:
    with vllm_serve(tiny_paths["qwen2"], "--max-model-len", "256", "--served-model-name",
                    "foo", count=2) as urls:
        yield urls


@pytest.fixture(scope="module")
def router(servers: list[str]) -> Iterator[str]:
    python = client_venv("vllm-router-venv", ROUTER_PACKAGES)
    binary = Path(python).parent / "vllm-router"
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), "--policy", "round_robin",
             "--worker-urls", *servers, "--worker-startup-timeout-secs", "60"],
            stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            yield url
        finally:
            stop(proc)


def _finished(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rollout_engine_requests_total{"))


def test_completions_through_router(router: str, servers: list[str]) -> None:
    body = {"model": "foo", "prompt": "The capital of", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    direct = httpx.post(servers[0] + "/v1/completions", json=body, timeout=60).json()
    before = [_finished(u) for u in servers]
    with httpx.Client(base_url=router, timeout=60) as c:
        outs = [c.post("/v1/completions", json=body) for _ in range(4)]
        assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
        assert [o.json()["choices"][0]["text"] for o in outs] == \
            [direct["choices"][0]["text"]] * 4
        assert {o.json()["model"] for o in outs} == {"foo"}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    streamed = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
    assert streamed == direct["choices"][0]["text"]
    # round robin: both servers answered
    served = [_finished(u) - b for u, b in zip(servers, before)]
    assert sum(served) == 5 and min(served) >= 2, served


def test_chat_completions_through_router(router: str) -> None:
    body = {"model": "foo", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=router, timeout=60) as c:
        for _ in range(2):   # one on each server
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert message["role"] == "assistant" and message["content"]
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(x)["choices"][0]["delta"].get("content") or ""
                   for x in lines[:-1] if json.loads(x)["choices"])
    assert text == message["content"]
