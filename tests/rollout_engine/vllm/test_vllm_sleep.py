"""vLLM's /sleep levels, staged /wake_up, /is_sleeping and /reset_prefix_cache on a live server:
level 1 restores the weights it kept in CPU memory; after level 2 the weights are stale and
generation is refused, naming why, until a refit rewrote them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.rollout_engine.vllm.control_server import (
    PROMPTS,
    greedy,
    served,
    stream_generate,
    w1_w2,
    wait_running,
)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    yield from served(w1_w2()[0])


@pytest.fixture
def http(server: tuple[str, Any]) -> Iterator[httpx.Client]:
    url, engine = server
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c
        c.post("/wake_up")
        c.post("/update_weights_from_disk", json={"model_path": w1_w2()[0]})
    engine.check_integrity()


def _generate(http: httpx.Client, n: int = 12) -> httpx.Response:
    return http.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": greedy(n)})


def test_level_1_keeps_the_weights_and_a_staged_wake_restores_them(http):
    before = _generate(http).json()["output_ids"]
    assert http.post("/sleep?level=1").json() == {"status": "sleeping", "level": 1}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = _generate(http)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
    r = http.post("/wake_up", params={"tags": ["weights"]})
    assert r.json() == {"status": "sleeping", "tags": ["weights"]}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    r = http.post("/wake_up", params={"tags": ["kv_cache"]})
    assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _generate(http).json()["output_ids"] == before


def test_level_2_weights_are_stale_until_a_refit(http):
    before = _generate(http).json()["output_ids"]
    assert http.post("/sleep?level=2").json() == {"status": "sleeping", "level": 2}
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    refused = _generate(http)
    assert refused.status_code == 503
    assert "stale" in refused.json()["error"]["message"]
    r = http.post("/update_weights_from_disk", json={"model_path": w1_w2()[0]})
    assert r.status_code == 200, r.text
    assert _generate(http).json()["output_ids"] == before


def test_level_2_staged_wake_with_a_refit_between(http):
    before = _generate(http).json()["output_ids"]
    http.post("/sleep?level=2&tags=weights")          # SkyRL sends tags; vLLM ignores them
    assert http.post("/wake_up?tags=weights").json()["status"] == "sleeping"
    assert http.post("/update_weights_from_disk",
                     json={"model_path": w1_w2()[0]}).status_code == 200
    assert http.post("/wake_up?tags=kv_cache").json()["status"] == "awake"
    assert _generate(http).json()["output_ids"] == before


def test_sleep_keep_mode_recomputes_frozen_requests_after_the_wake(http, server):
    url, engine = server
    t, box = stream_generate(url, PROMPTS[0], "sleeper", n=200)
    wait_running(engine, 1)
    assert http.post("/sleep?level=1&mode=keep").json()["status"] == "sleeping"
    assert http.post("/wake_up").json()["status"] == "awake"
    t.join(60)
    meta = box["final"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(box["final"]["output_ids"]) == 200
    alone = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": greedy(200)})
    assert alone.json()["output_ids"] == box["final"]["output_ids"]


def test_reset_prefix_cache_makes_a_repeated_prompt_miss(http, server):
    url, engine = server
    _generate(http)
    assert _generate(http).json()["meta_info"]["cached_tokens"] > 0
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert _generate(http).json()["meta_info"]["cached_tokens"] == 0
    t, box = stream_generate(url, PROMPTS[0], "holder", n=300)
    wait_running(engine, 1)
    assert http.post("/reset_prefix_cache").json() == {"success": False}   # it holds KV
    assert http.post("/reset_prefix_cache?reset_running_requests=true").json() == {
        "success": True}
    t.join(60)
    assert len(box["final"]["output_ids"]) == 300


def test_bad_levels_and_tags_are_400(http):
    r = http.post("/sleep?level=3")
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]
    r = http.post("/wake_up?tags=optimizer")
    assert r.status_code == 400 and "optimizer" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_wait_mode_sleeps_once_the_request_finished(http, server):
    url, engine = server
    t, box = stream_generate(url, PROMPTS[0], "finishing", n=40)
    wait_running(engine, 1)
    assert http.post("/sleep?level=1&mode=wait").json() == {"status": "sleeping", "level": 1}
    assert "finishing" not in engine.tm.states   # ended before the memory was released
    t.join(30)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(box["final"]["output_ids"]) == 40
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up").json()["status"] == "awake"
