"""The real sglang-router in PD mode (``--pd-disaggregation``) in front of one prefill server and
one decode server (each its scheduler in a child process): greedy and seeded outputs, their
logprobs and streams equal one whole server's, on /generate and /v1/completions.

The prefill server chunks its prefills (a small ``chunked_prefill_size``) and keeps its radix
cache; both run HiCache, so these keep working under disaggregation.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.rollout_engine.entrypoints.conftest import LiveServer, bound_socket, serve_app  # noqa: F401
from tests.rollout_engine.entrypoints.test_real_clients import (  # noqa: F401
    _wait_http,
    clients_venv,
)

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived"]


def _free_port() -> int:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


def _server(path: str, serve: Any, **kw: Any) -> LiveServer:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    engine = Engine(model_path=path, dtype="float32", device="cpu", context_length=512, **kw)
    app = create_app(engine)
    return LiveServer(serve(app), engine, app)


@pytest.fixture(scope="module")
def servers(qwen2_path: str, serve_app: Any) -> Iterator[dict[str, Any]]:  # noqa: F811
    boot = _free_port()
    made = {"single": _server(qwen2_path, serve_app, scheduler_mode="thread")}
    try:
        made["prefill"] = _server(qwen2_path, serve_app, disaggregation_mode="prefill",
                                  disaggregation_bootstrap_port=boot, chunked_prefill_size=8,
                                  enable_hierarchical_cache=True)
        made["decode"] = _server(qwen2_path, serve_app, disaggregation_mode="decode",
                                 enable_hierarchical_cache=True)
        yield {**made, "bootstrap_port": boot}
    finally:
        for s in made.values():
            s.engine.shutdown()


@pytest.fixture(scope="module")
def router(clients_venv: Path, servers: dict[str, Any]) -> Iterator[str]:  # noqa: F811
    port = _free_port()
    log = open(Path(os.environ.get("ROLLOUT_ENGINE_CACHE", "/tmp")) / "pd_router.log", "w")
    proc = subprocess.Popen(
        [str(clients_venv), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--pd-disaggregation",
         "--prefill", servers["prefill"].url, str(servers["bootstrap_port"]),
         "--decode", servers["decode"].url, "--prometheus-port", str(_free_port()),
         "--worker-startup-timeout-secs", "60"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _post(url: str, route: str, body: dict[str, Any]) -> Any:
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _same_logprobs(a: list[list[Any]], b: list[list[Any]]) -> None:
    assert [e[1] for e in a] == [e[1] for e in b]
    for x, y in zip(a, b):
        assert (x[0] is None) == (y[0] is None)
        if x[0] is not None:
            assert abs(x[0] - y[0]) <= 1e-4


def test_greedy_with_prompt_logprobs_equals_one_server(router: str,
                                                      servers: dict[str, Any]) -> None:
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16},
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
        want = _post(servers["single"].url, "/generate", body)
        got = _post(router, "/generate", body)
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        meta, ref = got["meta_info"], want["meta_info"]
        _same_logprobs(meta["output_token_logprobs"], ref["output_token_logprobs"])
        # the router prepends the prefill server's prompt logprobs to the decode's (none)
        _same_logprobs(meta["input_token_logprobs"], ref["input_token_logprobs"])
        assert [[t[1] for t in top] for top in meta["output_top_logprobs"]] == \
            [[t[1] for t in top] for top in ref["output_top_logprobs"]]
        assert meta["finish_reason"] == ref["finish_reason"]
        assert meta["prompt_tokens"] == ref["prompt_tokens"]


def test_seeded_samples_n_gt_1_equal_one_server(router: str, servers: dict[str, Any]) -> None:
    body = {"text": PROMPTS[1], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "top_k": 20, "max_new_tokens": 12, "n": 3,
                                "sampling_seed": 11}}
    want = _post(servers["single"].url, "/generate", body)
    got = _post(router, "/generate", body)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert len({tuple(g["output_ids"]) for g in got}) > 1   # the samples differ
    for g, w in zip(got, want):
        _same_logprobs(g["meta_info"]["output_token_logprobs"],
                       w["meta_info"]["output_token_logprobs"])


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_stream_equals_one_server(router: str, servers: dict[str, Any]) -> None:
    body = {"text": PROMPTS[0], "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    want = _stream(servers["single"].url, body)
    got = _stream(router, body)
    assert len(got) > 1
    assert got[-1]["output_ids"] == want[-1]["output_ids"] and got[-1]["text"] == want[-1]["text"]
    _same_logprobs(got[-1]["meta_info"]["output_token_logprobs"],
                   want[-1]["meta_info"]["output_token_logprobs"])
    assert got[-1]["meta_info"]["finish_reason"] == want[-1]["meta_info"]["finish_reason"]


def test_completions_route_equals_one_server(router: str, servers: dict[str, Any]) -> None:
    body = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
            "logprobs": 2}
    want = _post(servers["single"].url, "/v1/completions", body)
    got = _post(router, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    a, b = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])) <= 1e-4


def test_prefill_reuses_its_radix_cache_and_both_leak_nothing(
        router: str, servers: dict[str, Any]) -> None:
    body = {"text": PROMPTS[1] + " a dragon", "sampling_params": {"temperature": 0,
                                                                  "max_new_tokens": 4}}
    _post(router, "/generate", body)
    with httpx.Client(base_url=servers["prefill"].url, timeout=60) as c:
        before = c.get("/get_server_info").json()
    _post(router, "/generate", {**body, "text": PROMPTS[1] + " a dragon who"})
    with httpx.Client(base_url=servers["prefill"].url, timeout=60) as c:
        after = c.get("/get_server_info").json()
    assert after["stats"]["cached_tokens"] > before["stats"]["cached_tokens"]
    assert after["disaggregation"]["exported"] == before["disaggregation"]["exported"] + 1
    for role in ("prefill", "decode"):
        servers[role].assert_no_leak()
    with httpx.Client(base_url=servers["prefill"].url, timeout=60) as c:
        assert c.get("/get_server_info").json()["disaggregation"]["held"] == 0   # all released
