"""Prefill-decode transfers that fail: a decode client or a prefill server that hangs up
halfway, a room that never appears, an abort while the KV is on its way, and a pair whose
weights differ. Each ends the request it concerns with a clear abort, releases every KV
segment and slot it held, and leaves both servers serving."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_engine.disaggregation.wire import boot_id, recv_exact, recv_header, send_header
from tests.rollout_engine.disaggregation.pairs import (
    LOCAL,
    kv_layout,
    layout_bytes_per_token,
    pair_generate,
    perturbed_checkpoint,
    segments,
    wait_until,
)
from tests.rollout_engine.engines import thread_engine

GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def single(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512)


@pytest.fixture(scope="module")
def prefill(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512, disaggregation_mode="prefill",
                             disaggregation_bootstrap_port=0)


@pytest.fixture(scope="module")
def decode(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512, disaggregation_mode="decode")


def _pd(engine: Any) -> dict[str, Any]:
    return engine.get_server_info()["disaggregation"]


def _no_segments_left() -> None:
    # the prefill releases a segment on its bootstrap thread once the decode says "done"
    wait_until("every prefill KV segment released", lambda: not segments())


def _assert_pair_serves(prefill: Any, decode: Any, single: Any, room: int) -> None:
    ref = single.generate(PROMPT, GREEDY)
    _, out = pair_generate(prefill, decode, PROMPT, GREEDY, room)
    assert out["output_ids"] == ref["output_ids"]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_decode_client_hanging_up_midway_releases_the_segment(
        prefill: Any, decode: Any, single: Any, qwen2_path: str, shm: bool) -> None:
    room = 7100 + shm
    prefill.generate(PROMPT, GREEDY, bootstrap_host=LOCAL, bootstrap_room=room,
                     bootstrap_port=_pd(prefill)["bootstrap_port"])
    assert _pd(prefill)["held"] == 1 and len(segments()) == 1

    with socket.create_connection((LOCAL, _pd(prefill)["bootstrap_port"]), timeout=10) as conn:
        send_header(conn, {"op": "fetch", "room": str(room), "layout": kv_layout(qwen2_path),
                           "boot_id": boot_id(), "shm": shm, "wait_s": 5})
        header = recv_header(conn)
        assert header["ok"] is True
        if shm:
            assert header["shm_name"] is not None   # mapped by name: hang up without "done"
        else:
            assert header["shm_name"] is None
            recv_exact(conn, header["nbytes"] // 2)   # half the KV, then hang up

    wait_until("the prefill's KV segment released", lambda: not segments())
    assert _pd(prefill)["held"] == 0
    prefill.check_integrity()
    _assert_pair_serves(prefill, decode, single, room + 10)
    _no_segments_left()


def test_a_prefill_server_hanging_up_midway_aborts_the_decode_request(
        prefill: Any, decode: Any, single: Any, qwen2_path: str) -> None:
    layout = kv_layout(qwen2_path)
    prompt = [5, 17, 23, 42, 8, 99]
    nbytes = len(prompt) * layout_bytes_per_token(layout)
    asked: dict[str, Any] = {}
    server = socket.create_server((LOCAL, 0))

    def fake_prefill() -> None:
        conn, _ = server.accept()
        with conn:
            asked.update(recv_header(conn))
            record = {"input_ids": prompt, "token": 3, "weights": "default#0"}
            send_header(conn, {"ok": True, "record": record, "nbytes": nbytes,
                               "shm_name": None})
            conn.sendall(bytes(nbytes // 2))   # half the KV, then the connection closes

    thread = threading.Thread(target=fake_prefill, daemon=True)
    thread.start()
    out = decode.generate(input_ids=prompt, sampling_params=GREEDY, bootstrap_host=LOCAL,
                          bootstrap_port=server.getsockname()[1], bootstrap_room=7200)
    thread.join(10)
    server.close()

    assert asked["layout"] == layout and asked["room"] == "7200"
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert "KV transfer from the prefill server" in reason["message"]
    assert f"closed after {nbytes // 2} of {nbytes} bytes" in reason["message"]
    assert out["output_ids"] == []
    report = decode.check_integrity()
    assert report["idle"] is True
    assert (_pd(decode)["parked"], _pd(decode)["arrived"]) == (0, 0)
    _assert_pair_serves(prefill, decode, single, 7201)


def test_a_room_that_never_appears_times_out(prefill: Any, qwen2_path: str) -> None:
    gen = thread_engine(qwen2_path, context_length=512, disaggregation_mode="decode",
                        disaggregation_transfer_timeout=1.0)
    decode = next(gen)
    try:
        start = time.monotonic()
        out = decode.generate(PROMPT, GREEDY, bootstrap_host=LOCAL, bootstrap_room=7300,
                              bootstrap_port=_pd(prefill)["bootstrap_port"])
        waited = time.monotonic() - start
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "no KV for room '7300' after 1 s" in reason["message"]
        assert 0.9 < waited < 10
        assert (_pd(decode)["parked"], _pd(decode)["failed"]) == (0, 1)
        # the decode server still serves: a later pair request completes
        _, later = pair_generate(prefill, decode, PROMPT, GREEDY, 7301)
        assert later["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        next(gen, None)   # checks the KV integrity and shuts the engine down


def test_an_abort_while_the_transfer_waits_ends_it_and_leaks_nothing(
        prefill: Any, decode: Any, single: Any) -> None:
    got: dict[str, Any] = {}
    boot = {"bootstrap_host": LOCAL, "bootstrap_port": _pd(prefill)["bootstrap_port"],
            "bootstrap_room": 7400}
    cancelled = _pd(decode)["cancelled"]
    waiting = threading.Thread(target=lambda: got.update(
        out=decode.generate(PROMPT, GREEDY, rid="pd-waits", **boot)), daemon=True)
    waiting.start()
    wait_until("the decode request parked", lambda: _pd(decode)["parked"] == 1)

    decode.abort_request(rid="pd-waits")
    waiting.join(10)
    assert got["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert got["out"]["output_ids"] == []
    assert _pd(decode)["parked"] == 0 and _pd(decode)["cancelled"] == cancelled + 1
    assert decode.check_integrity()["idle"] is True

    # the prefill half arriving late exports KV nobody will copy: released, not held
    prefill.generate(PROMPT, GREEDY, **boot)
    wait_until("the orphaned room released", lambda: not segments()
               and _pd(prefill)["held"] == 0)
    _assert_pair_serves(prefill, decode, single, 7401)
    _no_segments_left()


def test_a_pair_whose_weights_differ_refuses_until_both_are_refitted(
        single: Any, qwen2_path: str, tmp_path: Path) -> None:
    from rollout_engine import Engine

    trained = perturbed_checkpoint(qwen2_path, tmp_path / "trained")
    made = [thread_engine(qwen2_path, context_length=512, disaggregation_mode="prefill",
                          disaggregation_bootstrap_port=0),
            thread_engine(qwen2_path, context_length=512, disaggregation_mode="decode")]
    prefill, decode = (next(g) for g in made)
    fresh = Engine(model_path=trained, scheduler_mode="thread", dtype="float32", device="cpu",
                   context_length=512)
    try:
        ok, message = decode.update_weights_from_disk(trained)
        assert ok, message
        _, refused = pair_generate(prefill, decode, PROMPT, GREEDY, 7500)
        reason = refused["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert reason["message"].startswith("the prefill and decode servers' weights differ")
        assert "computed under weights 'default#0'" in reason["message"]
        assert "holds 'default#1'" in reason["message"]
        assert "refit both servers" in reason["message"]
        _no_segments_left()

        ok, message = prefill.update_weights_from_disk(trained)
        assert ok, message
        ref = fresh.generate(PROMPT, GREEDY, return_logprob=True)
        _, out = pair_generate(prefill, decode, PROMPT, GREEDY, 7501, return_logprob=True)
        assert out["output_ids"] == ref["output_ids"]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        # the refit changed what the pair answers
        assert single.generate(PROMPT, GREEDY)["output_ids"] != ref["output_ids"]
        _no_segments_left()
    finally:
        fresh.shutdown()
        for g in made:
            next(g, None)
