"""The RL control routes over HTTP: sleep / wake, refit through tensor handles and disk, busy
and asleep statuses, pause / continue, versions, the admin key, malicious payloads."""

from __future__ import annotations

import base64
import gc
import glob
import os
import pickle
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.weights.loader import iter_safetensors

ADMIN = "admin-secret"
PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def rl_server(serve_app) -> Iterator[tuple[str, str, str]]:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app
    from rollout_engine.testing.tiny_model import tiny_model_path

    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    engine = Engine(model_path=w1, scheduler_mode="process", admin_api_key=ADMIN)
    try:
        yield serve_app(create_app(engine)), w1, w2
    finally:
        engine.shutdown()


def _gen(c: httpx.Client) -> httpx.Response:
    return c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                     "return_logprob": True})


def _client(url: str, admin: bool = True) -> httpx.Client:
    headers = {"Authorization": f"Bearer {ADMIN}"} if admin else {}
    return httpx.Client(base_url=url, timeout=120, headers=headers)


@pytest.fixture(scope="module")
def w2_output(rl_server) -> list[int]:
    from rollout_engine import Engine

    with Engine(model_path=rl_server[2], scheduler_mode="thread") as eng:
        return eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def test_control_routes_need_the_admin_key(rl_server):
    url = rl_server[0]
    with _client(url, admin=False) as c:
        assert c.post("/release_memory_occupation", json={}).status_code == 401
        assert c.post("/update_weights_from_disk", json={"model_path": "x"}).status_code == 401
        assert _gen(c).status_code == 200    # generation is not a control route


def test_sleep_wake_refit_over_http(rl_server, w2_output):
    url, w1, w2 = rl_server
    with _client(url) as c:
        assert c.post("/release_memory_occupation", json={}).status_code == 200
        r = _gen(c)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert c.post("/resume_memory_occupation").status_code == 200
        assert _gen(c).status_code == 503                       # weights are stale
        tensors = list(iter_safetensors(w2))
        payload = serialize_named_tensors(tensors)
        r = c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [payload], "weight_version": "step-1"})
        assert r.status_code == 200 and r.json()["success"], r.text
        out = _gen(c).json()
        assert out["output_ids"] == w2_output
        assert out["meta_info"]["weight_version"] == "step-1"
        assert c.get("/get_weight_version").json()["weight_version"] == "step-1"
        w = c.get("/get_weights_by_name", params={"name": "model.norm.weight",
                                                  "truncate_size": 4}).json()
        assert w["result"] == pytest.approx(dict(tensors)["model.norm.weight"][:4].tolist())
        r = c.post("/update_weights_from_disk", json={"model_path": w1, "weight_version": "w1"})
        assert r.status_code == 200, r.text
        assert c.post("/update_weight_version", json={"new_version": "w1b"}).json()["success"]


def test_malicious_payload_is_refused(rl_server, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()
    with _client(rl_server[0]) as c:
        before = _gen(c).json()["output_ids"]
        r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [bad]})
        assert r.status_code == 400 and "system" in r.json()["message"]
        assert not marker.exists()
        r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["%%%"]})
        assert r.status_code == 400
        r = c.post("/update_weights_from_disk", json={})
        assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]
        assert _gen(c).json()["output_ids"] == before


def _shm_files() -> set[str]:
    """The torch shared-memory files this process (the trainer here) created, still named."""
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


def test_refused_refits_over_http_leave_no_shared_memory(rl_server):
    """Refits the server refuses (asleep: 409; a field the route does not take: 400 before
    the scheduler sees it), sent by the trainer's client or by hand: once answered and the
    trainer lets go of its tensors, nothing of them is left in /dev/shm."""
    from trainer_bridge import RolloutClient, RolloutError

    url, w1, w2 = rl_server
    before = _shm_files()
    weights = list(iter_safetensors(w2))[:2]
    with _client(url) as c, RolloutClient(url, admin_api_key=ADMIN) as client:
        assert c.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        try:
            with pytest.raises(RolloutError) as refused:
                client.update_weights_from_tensor((n, t.clone()) for n, t in weights)
            assert refused.value.status == 409, refused.value
            del refused   # its traceback holds the client's frames, and so the tensors
            sent = [(n, t.clone()) for n, t in weights]
            body = {"serialized_named_tensors": [serialize_named_tensors(sent)]}
            assert c.post("/update_weights_from_tensor", json=body).status_code == 409
            r = c.post("/update_weights_from_tensor", json={**body, "colour": "red"})
            assert r.status_code == 400, r.text
            del sent
        finally:
            assert c.post("/resume_memory_occupation", json={"tags": ["weights"]}
                          ).status_code == 200
            r = c.post("/update_weights_from_disk", json={"model_path": w1})
            assert r.status_code == 200, r.text
    gc.collect()
    assert _shm_files() - before == set()


def _start_long_request(url: str, max_new_tokens: int) -> tuple[threading.Thread, dict]:
    """A long greedy request in a thread; returns once the scheduler is running it."""
    box: dict = {}

    def long_request() -> None:
        with _client(url) as c:
            box["r"] = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
                "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    with _client(url) as c:
        deadline = time.time() + 30
        while c.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.02)
    return t, box


def test_release_while_busy_is_409_and_requests_complete(rl_server):
    url = rl_server[0]
    t, box = _start_long_request(url, 300)
    with _client(url) as c:
        # paused in place it keeps its KV and cannot finish: the engine is busy for sure
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        r = c.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 409, r.text
        assert c.post("/flush_cache").status_code == 409
        assert c.post("/continue_generation").status_code == 200
        t.join()
        assert box["r"].status_code == 200
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_and_continue(rl_server):
    url = rl_server[0]
    t, box = _start_long_request(url, 1800)   # seconds of decoding: still running at the pause
    with _client(url) as c:
        r = c.post("/pause_generation", json={"mode": "abort"})
        assert r.status_code == 200 and r.json()["status"] == "ok"   # SGLang's answer shape
        t.join()
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert c.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        r = c.post("/continue_generation")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert _gen(c).status_code == 200
        assert c.get("/check_integrity").status_code == 200
