"""The real vllm-router in its PD mode (``--vllm-pd-disaggregation``: vLLM's two-stage
protocol with ``kv_transfer_params``) in front of one prefill server and one decode server:
completions and chat, whole and streamed, equal one whole server's, and the prompt's KV went
through the transfer."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.rollout_engine.disaggregation.test_pd_router import _free_port, _post, _server
from tests.rollout_engine.entrypoints.conftest import serve_app  # noqa: F401
from tests.rollout_engine.vllm.serve_process import stop, wait_healthy
from tests.venvs import client_venv

ROUTER_PACKAGES = ["vllm-router==0.1.17"]

pytestmark = pytest.mark.slow   # builds the vllm-router venv; the PD path: test_pd_router.py


@pytest.fixture(scope="module")
def servers(qwen2_path: str, serve_app: Any) -> Iterator[dict[str, Any]]:  # noqa: F811
    made = {"single": _server(qwen2_path, serve_app, scheduler_mode="thread")}
    try:
        made["prefill"] = _server(qwen2_path, serve_app, scheduler_mode="thread",
                                  disaggregation_mode="prefill",
                                  disaggregation_bootstrap_port=_free_port())
        made["decode"] = _server(qwen2_path, serve_app, scheduler_mode="thread",
                                 disaggregation_mode="decode")
        yield made
    finally:
        for s in made.values():
            s.engine.shutdown()


@pytest.fixture(scope="module")
def router(servers: dict[str, Any]) -> Iterator[str]:
    binary = Path(client_venv("vllm-router-venv", ROUTER_PACKAGES)).parent / "vllm-router"
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(_free_port()), "--vllm-pd-disaggregation",
             "--prefill", servers["prefill"].url, "--decode", servers["decode"].url,
             "--worker-startup-timeout-secs", "60"],
            stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            yield url
        finally:
            stop(proc)


def _fetched(server: Any) -> int:
    with server.client() as c:
        return int(c.get("/get_server_info").json()["disaggregation"]["fetched"])


def test_completions_and_chat_equal_one_server(router: str, servers: dict[str, Any]) -> None:
    before = _fetched(servers["decode"])
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 10,
            "temperature": 0, "logprobs": 2}
    want = _post(servers["single"].url, "/v1/completions", body)
    got = _post(router, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    a, b = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])) <= 1e-4
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 8, "temperature": 0}
    assert _post(router, "/v1/chat/completions", chat)["choices"][0]["message"] == \
        _post(servers["single"].url, "/v1/chat/completions", chat)["choices"][0]["message"]
    assert _fetched(servers["decode"]) == before + 2   # both prompts' KV came from the prefill


def test_streamed_completion_equals_one_server(router: str, servers: dict[str, Any]) -> None:
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 12,
            "temperature": 0, "stream": True}
    want = _post(servers["single"].url, "/v1/completions", {**body, "stream": False})
    text = ""
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == want["choices"][0]["text"]
    for role in ("prefill", "decode"):
        servers[role].assert_no_leak()


def test_kv_transfer_params_on_a_whole_server_is_a_400(servers: dict[str, Any]) -> None:
    r = httpx.post(servers["single"].url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": "x", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400
    assert "disaggregation-mode prefill" in r.json()["error"]["message"]
