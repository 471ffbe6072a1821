"""vLLM's /pause modes, /resume, /is_paused and /abort_requests on a live server: requests
frozen by ``keep`` finish on the weights loaded while paused, their weight-version spans switching
at the token where the pause fell."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.rollout_engine.vllm.control_server import (
    LONG,
    PROMPTS,
    greedy,
    served,
    stream_generate,
    tokens_so_far,
    w1_w2,
    wait_running,
    wait_until,
)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    yield from served(w1_w2()[0])


@pytest.fixture(scope="module")
def w2_engine() -> Iterator[Any]:
    from tests.rollout_engine.engines import thread_engine

    yield from thread_engine(w1_w2()[1])


@pytest.fixture
def http(server: tuple[str, Any]) -> Iterator[httpx.Client]:
    url, engine = server
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c
    c = httpx.Client(base_url=url, timeout=120)
    c.post("/resume")   # a failed test leaves no pause behind
    c.post("/update_weights_from_disk", json={"model_path": w1_w2()[0],
                                              "weight_version": "default"})
    c.close()
    engine.check_integrity()


def _pause_refit_resume(http: httpx.Client, engine: Any, clear_cache: str
                        ) -> tuple[list[dict[str, Any]], list[int]]:
    started = [stream_generate(str(http.base_url).rstrip("/"), p, f"keep-{i}")
               for i, p in enumerate(PROMPTS)]
    wait_running(engine, len(PROMPTS))
    r = http.post(f"/pause?mode=keep&clear_cache={clear_cache}")
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    cut = [tokens_so_far(engine, f"keep-{i}") for i in range(len(PROMPTS))]
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert all(0 < k < LONG for k in cut)
    r = http.post("/update_weights_from_disk", json={"model_path": w1_w2()[1],
                                                     "weight_version": "v2"})
    assert r.status_code == 200, r.text
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.get("/is_paused").json() == {"is_paused": False}
    for t, _ in started:
        t.join(120)
    return [box["final"] for _, box in started], cut


@pytest.mark.parametrize("clear_cache", ["false", "true"])
def test_keep_finishes_on_the_new_weights_with_spans_at_the_pause(http, server, w2_engine,
                                                                   clear_cache):
    """clear_cache=false freezes the requests with their KV; true (vLLM's default) gives the KV
    back and recomputes it under the new weights on resume: then every token after the switch
    is exactly what W2 samples after the same prefix."""
    finals, cut = _pause_refit_resume(http, server[1], clear_cache)
    for final, k, prompt in zip(finals, cut, PROMPTS):
        meta, out = final["meta_info"], final["output_ids"]
        assert meta["finish_reason"]["type"] == "length" and len(out) == LONG
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": k},
                                           {"version": "v2", "start": k, "end": LONG}]
        assert meta["weight_version"] == "v2"
        if clear_cache == "true":
            again = w2_engine.generate(input_ids=prompt + out[:k],
                                       sampling_params=greedy(LONG - k))
            assert again["output_ids"] == out[k:]


def test_wait_answers_once_in_flight_requests_finished_and_holds_new_ones(http, server):
    url, engine = server
    t, box = stream_generate(url, PROMPTS[0], "drained", n=120)
    wait_running(engine, 1)
    assert http.post("/pause?mode=wait&clear_cache=false").json() == {"status": "paused"}
    assert "drained" not in engine.tm.states   # it had finished when the pause was answered
    t.join(30)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(box["final"]["output_ids"]) == 120
    assert http.get("/is_paused").json() == {"is_paused": True}
    late, late_box = stream_generate(url, PROMPTS[1], "late", n=4)
    wait_until(lambda: engine.get_server_info()["num_waiting_reqs"] == 1, "the new one waits")
    assert engine.get_server_info()["num_running_reqs"] == 0
    assert http.post("/resume").json() == {"status": "resumed"}
    late.join(30)
    assert len(late_box["final"]["output_ids"]) == 4


def test_abort_aborts_in_flight_and_abort_requests_names_them(http, server):
    url, engine = server
    t, box = stream_generate(url, PROMPTS[0], "aborted")
    wait_running(engine, 1)
    assert http.post("/pause?mode=abort").json() == {"status": "paused"}
    t.join(30)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert http.post("/resume").json() == {"status": "resumed"}
    t, box = stream_generate(url, PROMPTS[1], "named")
    wait_running(engine, 1)
    r = http.post("/abort_requests", json={"request_ids": ["named"]})
    assert r.json() == {"status": "aborted", "aborted": 1}
    t.join(30)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_bad_input_is_a_400_naming_it(http):
    r = http.post("/pause?mode=later")
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    r = http.post("/abort_requests", json={"request_ids": "all"})
    assert r.status_code == 400 and "request_ids" in r.json()["error"]
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_wait_after_keep_lets_the_frozen_requests_finish(http, server):
    """As vLLM's PAUSED_NEW replaces PAUSED_ALL: the frozen request runs to its end, then the
    wait pause answers."""
    url, engine = server
    t, box = stream_generate(url, PROMPTS[1], "frozen", n=60)
    wait_running(engine, 1)
    assert http.post("/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
    r = http.post("/pause?mode=wait&clear_cache=false", timeout=60)
    assert r.json() == {"status": "paused"}
    assert "frozen" not in engine.tm.states
    t.join(30)
    assert len(box["final"]["output_ids"]) == 60
    assert http.get("/is_paused").json() == {"is_paused": True}
