"""The native routes of the rollout server against a live uvicorn server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from rollout_engine.entrypoints.http_server import create_app
from tests.rollout_engine.entrypoints.conftest import CONTEXT_LEN, LiveServer

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order; asserts the framing."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def stream_chunks(c: httpx.Client, body: dict) -> list[dict]:
    r = c.post("/generate", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_documented_shape(live_server: LiveServer) -> None:
    with live_server.client() as c:
        r = c.post("/generate", json={"text": "hello world", "sampling_params": GREEDY,
                                      "return_logprob": True, "top_logprobs_num": 2,
                                      "rid": "shape-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["prompt_tokens"] > 0 and meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in lps)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert out["text"] == live_server.engine.tokenizer.decode(out["output_ids"],
                                                              skip_special_tokens=True)


def test_generate_equals_in_process_engine(live_server: LiveServer) -> None:
    """The HTTP layer adds nothing: same ids, text and logprobs as ``Engine.generate``."""
    prompts = ["The quick brown fox", "hello", "a b c d e f"]
    params = {"max_new_tokens": 10, "temperature": 0.8, "sampling_seed": 1234}
    expected = live_server.engine.generate(prompt=prompts, sampling_params=params,
                                           return_logprob=True)
    with live_server.client() as c:
        got = c.post("/generate", json={"text": prompts, "sampling_params": params,
                                        "return_logprob": True}).json()
        ids = [live_server.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        by_ids = c.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
    assert isinstance(got, list) and len(got) == 3
    for e, g, b in zip(expected, got, by_ids):
        assert g["output_ids"] == e["output_ids"] == b["output_ids"]
        assert g["text"] == e["text"]
        for (lp1, t1, _), (lp2, t2, _) in zip(g["meta_info"]["output_token_logprobs"],
                                              e["meta_info"]["output_token_logprobs"]):
            assert t1 == t2 and lp1 == pytest.approx(lp2, abs=1e-5)


def test_stream_is_cumulative_as_sglang_streams(live_server: LiveServer) -> None:
    """Each chunk carries the whole text, output_ids and output logprobs so far (SGLang's
    default; slime's streaming reader keeps only the last chunk)."""
    body = {"text": "Once upon a time", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 7,
                                "ignore_eos": True}}
    with live_server.client() as c:
        full = c.post("/generate", json=body).json()
        chunks = stream_chunks(c, body)
    assert len(chunks) > 1
    last = chunks[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    assert [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]] == \
        pytest.approx([lp for lp, _, _ in full["meta_info"]["output_token_logprobs"]], abs=1e-5)
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert len(b["output_ids"]) > len(a["output_ids"])
    for ch in chunks:
        assert [t for _, t, _ in ch["meta_info"]["output_token_logprobs"]] == ch["output_ids"]
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all("index" not in ch for ch in chunks)


def test_stream_batch_and_n_carry_index(live_server: LiveServer) -> None:
    body = {"text": ["alpha", "beta"], "rid": ["sb-a", "sb-b"],
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 2,
                                "sampling_seed": 3}}
    with live_server.client() as c:
        full = c.post("/generate", json={**body, "rid": ["nb-a", "nb-b"]}).json()
        chunks = stream_chunks(c, body)
    assert len(full) == 4
    by_index: dict[int, list[dict]] = {}
    for ch in chunks:
        by_index.setdefault(ch["index"], []).append(ch)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, res in enumerate(full):
        got = by_index[i]
        assert got[0]["meta_info"]["id"] == f"sb-{'ab'[i // 2]}-{i % 2}"
        assert got[-1]["output_ids"] == res["output_ids"]   # cumulative chunks
        assert got[-1]["text"] == res["text"]


def test_return_text_in_logprobs(live_server: LiveServer) -> None:
    with live_server.client() as c:
        out = c.post("/generate", json={
            "text": "hello", "sampling_params": GREEDY, "return_logprob": True,
            "top_logprobs_num": 1, "logprob_start_len": 0, "return_text_in_logprobs": True}).json()
    tok = live_server.engine.tokenizer
    meta = out["meta_info"]
    for _lp, tid, text in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
        assert text == tok.decode([tid], skip_special_tokens=False)
    assert meta["input_token_logprobs"][0][0] is None


@pytest.mark.parametrize("body, fragment", [
    ({}, "exactly one of"),
    ({"text": "hi", "input_ids": [1]}, "exactly one of"),
    ({"text": 5}, "prompt"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "hi", "sampling_params": {"n": 100000}}, "n"),
    ({"input_ids": [1] * (CONTEXT_LEN + 1)}, "context length"),
    ({"input_ids": [10**6]}, "vocabulary"),
    ({"text": "hi", "stream": "yes"}, "stream"),
    ({"text": "hi", "unknown_field": 1}, "unknown_field"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
])
def test_bad_generate_bodies_are_400(live_server: LiveServer, body: dict, fragment: str) -> None:
    with live_server.client() as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_bad_requests_are_json_errors(live_server: LiveServer) -> None:
    with live_server.client() as c:
        cases = [
            (c.post("/generate", content=b"{not json", headers={"content-type":
                                                                "application/json"}), 400),
            (c.post("/generate", content=b"text=hi", headers={"content-type":
                                                              "application/x-www-form-urlencoded"}),
             400),
            (c.post("/generate", content=b"[1, 2]", headers={"content-type":
                                                             "application/json"}), 400),
            (c.post("/generate", content=b"\xff\xfe", headers={"content-type":
                                                               "application/json"}), 400),
            (c.post("/generate", content=b"[" * 100000, headers={"content-type":
                                                                 "application/json"}), 400),
            (c.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}), 400),
            (c.post("/v1/completions", json={"prompt": "hi", "nonsense": 1}), 400),
            (c.post("/v1/chat/completions", json={"messages": []}), 400),
            (c.post("/v1/chat/completions", json={"messages": [{"role": "user"}],
                                                  "top_logprobs": 3}), 400),
            (c.get("/no/such/route"), 404),
            (c.get("/generate"), 405),
            (c.post("/abort_request", json={}), 400),
        ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.json()["error"]["message"]
    with live_server.client() as c:
        assert c.get("/health").status_code == 200


def test_info_routes(live_server: LiveServer) -> None:
    with live_server.client() as c:
        for path in ("/get_model_info", "/model_info"):
            info = c.get(path).json()
            assert info["model_path"] == live_server.engine.config.model_path
            assert info["is_generation"] is True and info["architectures"]
            assert info["weight_version"] == "default"
        for path in ("/get_server_info", "/server_info"):
            info = c.get(path).json()
            assert info["max_total_num_tokens"] > 0 and info["page_size"] == 1
            assert info["api_key"] is None and info["scheduler_pid"] == \
                live_server.engine.tm.host.pid
        assert c.get("/get_weight_version").json() == {"weight_version": "default"}
        assert c.get("/health_generate").status_code == 200
        assert c.get("/health").json() == {"status": "ok"}


def test_flush_cache_busy_409_then_200(live_server: LiveServer) -> None:
    live_server.wait_idle()
    body = {"text": "long", "rid": "busy-1", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    done = threading.Event()

    def run() -> None:
        with live_server.client() as c, c.stream("POST", "/generate", json=body) as r:
            for _ in r.iter_lines():
                pass
        done.set()

    t = threading.Thread(target=run)
    t.start()
    with live_server.client() as c:
        deadline = time.time() + 20
        while c.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.02)
        for method in ("GET", "POST"):
            r = c.request(method, "/flush_cache")
            assert r.status_code == 409, r.text
            assert r.json()["success"] is False and "in flight" in r.json()["message"]
        assert c.post("/abort_request", json={"rid": "busy-1"}).json()["success"] is True
        assert done.wait(20)
        live_server.wait_idle()
        r = c.post("/flush_cache")
        assert r.status_code == 200 and r.json()["success"] is True
    t.join()
    live_server.assert_no_leak()


def test_metrics_exposition(live_server: LiveServer) -> None:
    with live_server.client() as c:
        c.post("/generate", json={"text": "count me", "sampling_params": GREEDY})
        stream_chunks(c, {"text": "count me too", "sampling_params": GREEDY})
        text = c.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("num_running_reqs", "num_waiting_reqs", "kv_usage_ratio", "cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total", "scheduler_alive"):
        assert f"rollout_engine_{name}" in values, name
    assert values["rollout_engine_generation_tokens_total"] >= 16
    assert values["rollout_engine_e2e_request_latency_seconds_count"] >= 2
    assert values['rollout_engine_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert "# TYPE rollout_engine_e2e_request_latency_seconds histogram" in text


def test_api_keys(live_server: LiveServer) -> None:
    app = create_app(live_server.engine, api_key="user-key", admin_api_key="admin-key")
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    with TestClient(app) as c:
        for path in ("/health", "/get_model_info", "/metrics", "/v1/models"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers=user).status_code == 200
            assert c.get(path, headers=admin).status_code == 200
        r = c.post("/generate", json={"text": "hi", "sampling_params": GREEDY})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert c.post("/generate", headers=user,
                      json={"text": "hi", "sampling_params": GREEDY}).status_code == 200
        for method, path in (("GET", "/check_integrity"), ("POST", "/flush_cache")):
            assert c.request(method, path, headers=user).status_code == 401
            assert c.request(method, path, headers=admin).status_code == 200
        assert c.post("/abort_request", headers=user,
                      json={"abort_all": True}).status_code == 401
        assert c.post("/abort_request", headers=user, json={"rid": "x"}).status_code == 200
        assert c.post("/abort_request", headers=admin,
                      json={"abort_all": True}).status_code == 200
