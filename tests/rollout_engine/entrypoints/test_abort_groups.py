"""Aborting by the caller's rid stops every request its generate call made: the ``n > 1``
samples and the batch members (``GenerateReq.groups``), running or still queued, through the
Python ``Engine`` and the HTTP route; nothing else, and no KV leaks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tests.rollout_engine.entrypoints.conftest import LiveServer

LONG = 400          # decode steps the aborted requests would run if they were not aborted
DEADLINE = 60.0


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _result(t: threading.Thread, box: dict[str, Any]) -> Any:
    t.join(DEADLINE)
    assert not t.is_alive(), "the call did not return"
    if "error" in box:
        raise box["error"]
    return box["out"]


def _wait_for(info: Callable[[], dict[str, Any]], running: int, waiting: int = 0) -> None:
    deadline = time.monotonic() + DEADLINE
    while True:
        i = info()
        if (i["num_running_reqs"], i["num_waiting_reqs"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, (
            f"never reached {running} running, {waiting} waiting: "
            f"{i['num_running_reqs']} running, {i['num_waiting_reqs']} waiting")
        time.sleep(0.01)


def _aborted(out: dict[str, Any]) -> bool:
    meta = out["meta_info"]
    return meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < LONG // 4


def test_engine_abort_request_stops_every_sample_and_batch_member(qwen2_path, make_engine):
    """Paused in place with the groups running (so the abort cannot race their end), then a
    group queued behind the pause: aborting the callers' rids stops all of them, a batch
    prompt's rid stops only its own samples, and a request outside the groups runs on."""
    engine = make_engine(qwen2_path)
    long = {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}
    grp1 = _in_thread(lambda: engine.generate(input_ids=[5, 6, 7, 8], rid="grp1",
                                              sampling_params={**long, "n": 4}))
    batch = _in_thread(lambda: engine.generate(input_ids=[[9, 10, 11], [12, 13, 14, 15]],
                                               rid="b", sampling_params={**long, "n": 2}))
    other = _in_thread(lambda: engine.generate(input_ids=[5, 6, 7, 8], rid="grp1x",
                                               sampling_params={**long, "max_new_tokens": 40}))
    _wait_for(engine.get_server_info, running=9)
    engine.pause_generation("in_place")
    grp2 = _in_thread(lambda: engine.generate(input_ids=[20, 21, 22], rid="grp2",
                                              sampling_params={**long, "n": 3}))
    _wait_for(engine.get_server_info, running=9, waiting=3)
    engine.abort_request("grp1")
    engine.abort_request("grp2")
    engine.abort_request("b_0")
    _wait_for(engine.get_server_info, running=3)   # b_1-0, b_1-1 and grp1x run on
    engine.abort_request("b")
    engine.continue_generation()
    for t, box in (grp1, grp2, batch):
        outs = _result(t, box)
        assert len(outs) in (3, 4) and all(_aborted(o) for o in outs), outs
    assert all(o["meta_info"]["completion_tokens"] == 0 for o in _result(*grp2))
    kept = _result(*other)
    assert kept["meta_info"]["finish_reason"]["type"] == "length"
    assert kept["meta_info"]["completion_tokens"] == 40
    _wait_for(engine.get_server_info, running=0)
    report = engine.check_integrity()
    assert report["idle"] and report["owned_tokens"] == 0


def test_http_abort_request_stops_every_sample_and_batch_member(live_server: LiveServer):
    """``/abort_request {"rid": X}`` with X the rid of a batch call and of an ``n > 1`` call:
    every member ends with an abort, and the KV invariant holds once idle."""
    live_server.wait_idle()
    long = {"max_new_tokens": LONG, "ignore_eos": True}

    def post(body: dict[str, Any]) -> Any:
        with live_server.client() as c:
            r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    batch = _in_thread(lambda: post({"input_ids": [[9, 10, 11], [12, 13]], "rid": "hb",
                                     "sampling_params": long}))
    samples = _in_thread(lambda: post({"input_ids": [5, 6, 7], "rid": "hs",
                                       "sampling_params": {**long, "n": 2}}))
    with live_server.client() as c:
        def info() -> dict[str, Any]:
            return c.get("/get_server_info").json()

        _wait_for(info, running=4)
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        try:
            for rid in ("hb", "hs"):
                r = c.post("/abort_request", json={"rid": rid})
                assert r.status_code == 200 and r.json()["success"] is True
        finally:
            assert c.post("/continue_generation").status_code == 200
    for t, box in (batch, samples):
        outs = _result(t, box)
        assert len(outs) == 2 and all(_aborted(o) for o in outs), outs
    live_server.assert_no_leak()


def test_http_prefix_abort_stops_every_rid_with_that_prefix_and_says_why(
        live_server: LiveServer):
    """An RL router stops one adapter's requests with ``{"rid": "<adapter>::", "prefix":
    true}``; SGLang's ``abort_message`` is what their finish reason says. Requests whose rid
    does not start with the prefix run on."""
    live_server.wait_idle()
    long = {"max_new_tokens": LONG, "ignore_eos": True}

    def post(rid: str, max_new_tokens: int = LONG) -> Any:
        with live_server.client() as c:
            r = c.post("/generate", json={"input_ids": [5, 6, 7], "rid": rid,
                                          "sampling_params": {**long,
                                                              "max_new_tokens": max_new_tokens}})
        assert r.status_code == 200, r.text
        return r.json()

    mine = [_in_thread(lambda rid=rid: post(rid)) for rid in ("lora-a::1", "lora-a::2")]
    # long enough that all three are seen running together (30 tokens could end first)
    other = _in_thread(lambda: post("lora-b::1", LONG // 2))
    with live_server.client() as c:
        _wait_for(lambda: c.get("/get_server_info").json(), running=3)
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        try:
            r = c.post("/abort_request", json={"rid": "lora-a::", "prefix": True,
                                               "abort_message": "adapter unloaded"})
            assert r.status_code == 200, r.text
            bad = c.post("/abort_request", json={"rid": "lora-a::", "prefix": "yes"})
            assert bad.status_code == 400 and "prefix" in bad.json()["error"]["message"]
        finally:
            assert c.post("/continue_generation").status_code == 200
    for t, box in mine:
        out = _result(t, box)
        assert out["meta_info"]["finish_reason"] == {"type": "abort",
                                                     "message": "adapter unloaded"}
    kept = _result(*other)
    assert kept["meta_info"]["finish_reason"]["type"] == "length"
    assert kept["meta_info"]["completion_tokens"] == LONG // 2
    live_server.assert_no_leak()
