"""miles' weight update, replayed against our server, with the payloads miles of 2026-08 sends:

    pause       POST /pause_generation {"mode": "retract"} (--pause-generation-mode's default),
                then flush_cache: GET /flush_cache, retried 60 times a second apart until it
                answers 200, else TimeoutError (miles/backends/sglang_utils/sglang_engine.py
                SGLangEngine.pause_generation / flush_cache)
    bracket     POST /begin_weight_update {"selector": "all"}, the update, POST
                /end_weight_update {}, POST /continue_generation {}
                (miles/backends/megatron_utils/update_weight/common.py begin_weight_update /
                end_weight_update, update_weight_from_tensor.py UpdateWeightFromTensor)
    update      POST /update_weights_from_tensor {serialized_named_tensors, load_format: null,
                flush_cache: false, selector: "all", weight_version}
                (SGLangEngine.update_weights_from_tensor)
    checker     POST /weights_checker {action, allow_quant_error, selector[, skip_tensor_list]}
                (SGLangEngine.check_weights): snapshot and reset_tensors at start with
                --check-weight-update-equal (miles/ray/placement_group.py), compare after the
                first update (train.py), checksum after every update when the event log is on
                (miles/ray/train/group.py, flattened by miles/utils/audit_utils/checksum_utils.py)

A retracted request holds no KV, so the flush that follows the pause succeeds while it waits;
it is recomputed when generation continues, to the same greedy tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import httpx
import pytest
import torch

from rollout_engine.protocol.tensor_payload import serialize_named_tensors
from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import served_over_http

LONG = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 12], [5, 6, 7, 8], [40, 41, 42]]
MAX_RUNNING = 2


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def served(w1_w2: tuple[str, str]) -> Iterator[tuple[str, Any]]:
    """A thread-mode fp32 engine on W1 running at most two requests at once, over HTTP."""
    from rollout_engine import Engine

    engine = Engine(model_path=w1_w2[0], scheduler_mode="thread", dtype="float32",
                    device="cpu", context_length=512, max_running_requests=MAX_RUNNING)
    try:
        for url in served_over_http(engine):
            yield url, engine
        engine.check_integrity()
    finally:
        engine.shutdown()


# -- miles' calls -----------------------------------------------------------------------------
def miles_flush_cache(c: httpx.Client) -> None:
    """SGLangEngine.flush_cache: GET /flush_cache until 200, 60 tries a second apart. While the
    engine is paused nothing changes between tries, so a first 409 would be a 409 60 times."""
    last = None
    for _ in range(60):
        r = c.get("/flush_cache")
        if r.status_code == 200:
            return
        last = r.text
        if c.get("/get_server_info").json()["paused"]:
            break   # paused: every retry sees the same queue
        time.sleep(1)
    raise TimeoutError(f"Timeout while flushing cache: {last}")


def miles_check_weights(c: httpx.Client, action: str, allow_quant_error: bool = False,
                        selector: str = "all", skip_list: Optional[list[str]] = None
                        ) -> httpx.Response:
    """SGLangEngine.check_weights: the payload, POSTed to /weights_checker."""
    payload: dict[str, Any] = {"action": action, "allow_quant_error": allow_quant_error,
                               "selector": selector}
    if skip_list is not None:
        payload["skip_tensor_list"] = skip_list
    return c.post("/weights_checker", json=payload)


def miles_update(c: httpx.Client, named: list[tuple[str, torch.Tensor]], version: str) -> Any:
    """UpdateWeightFromTensor.update_weights on rank 0 of one engine; the end's answer."""
    assert c.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    miles_flush_cache(c)
    r = c.post("/begin_weight_update", json={"selector": "all"})
    assert r.status_code == 200, r.text
    r = c.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(named)], "load_format": None,
        "flush_cache": False, "selector": "all", "weight_version": version})
    assert r.status_code == 200 and r.json()["success"], r.text
    end = c.post("/end_weight_update", json={})
    assert end.status_code == 200, end.text
    assert c.post("/continue_generation", json={}).status_code == 200
    return end.json()


def miles_engine_checksums(body: dict[str, Any]) -> dict[str, str]:
    """checksum_utils._merge_inference_engine_ranks for one engine's answer."""
    assert body.get("success", False), body
    ranks = body.get("ranks", []) or []
    assert ranks, body

    def gpu_rank(rank_info: dict[str, Any]) -> int:
        gpu_ranks = {role_info["rank"] for role_info in rank_info["parallelism_info"]}
        assert len(gpu_ranks) == 1, rank_info
        return next(iter(gpu_ranks))

    merged = {}
    for rank_info in sorted(ranks, key=gpu_rank):
        for name, value in rank_info["checksums"].items():
            merged[f"rank{gpu_rank(rank_info)}/{name}"] = value
    return merged


# -- pause (retract) then flush ---------------------------------------------------------------
def _stream(url: str, ids: list[int], chunks: list[dict[str, Any]]) -> None:
    body = {"input_ids": ids, "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))


def _wait_for(c: httpx.Client, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        info = c.get("/get_server_info").json()
        if (info["num_running_reqs"], info["num_waiting_reqs"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.01)


@pytest.mark.parametrize("num_requests", [2, 4], ids=["one-group", "queued-behind"])
def test_flush_after_a_retracting_pause_then_the_retracted_finish_as_unpaused(
        served: tuple[str, Any], num_requests: int) -> None:
    url, engine = served
    prompts = PROMPTS[:num_requests]
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=LONG)]
    streams: list[list[dict[str, Any]]] = [[] for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(url, ids, box))
               for ids, box in zip(prompts, streams)]
    with httpx.Client(base_url=url, timeout=60) as c:
        for t in threads:
            t.start()
        try:
            running = min(num_requests, MAX_RUNNING)
            _wait_for(c, running, num_requests - running)   # the rest queue behind them
            r = c.post("/pause_generation", json={"mode": "retract"})
            assert r.status_code == 200, r.text
            info = c.get("/get_server_info").json()
            assert (info["num_running_reqs"], info["num_waiting_reqs"]) == (0, num_requests)
            miles_flush_cache(c)
            info = c.get("/get_server_info").json()
            assert info["kv_cached_tokens"] == 0 and info["num_waiting_reqs"] == num_requests
            report = c.get("/check_integrity").json()["result"]
            assert report["owned_tokens"] == 0
            assert report["free_tokens"] == report["total_tokens"]
        finally:   # a failed check still lets the requests finish
            assert c.post("/continue_generation", json={}).status_code == 200
            for t in threads:
                t.join(120)
    assert [s[-1]["output_ids"] for s in streams] == want
    assert all(s[-1]["meta_info"]["finish_reason"]["type"] == "length" for s in streams)
    engine.check_integrity()


def test_flush_is_still_refused_while_a_request_holds_kv(served: tuple[str, Any]) -> None:
    url, engine = served
    chunks: list[dict[str, Any]] = []
    t = threading.Thread(target=_stream, args=(url, PROMPTS[0], chunks))
    with httpx.Client(base_url=url, timeout=60) as c:
        t.start()
        try:
            _wait_for(c, 1, 0)
            assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            r = c.get("/flush_cache")
            assert r.status_code == 409 and "hold KV" in r.json()["message"]
        finally:
            assert c.post("/continue_generation", json={}).status_code == 200
            t.join(120)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


# -- the bracket and the weight checker --------------------------------------------------------
def _weights(path: str) -> list[tuple[str, torch.Tensor]]:
    return sorted(iter_safetensors(path))


def test_miles_checked_weight_updates(served: tuple[str, Any], w1_w2: tuple[str, str]) -> None:
    url, engine = served
    w1, w2 = _weights(w1_w2[0]), _weights(w1_w2[1])
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    want = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy)["output_ids"]
    with httpx.Client(base_url=url, timeout=60) as c:
        # --check-weight-update-equal: snapshot the checkpoint's weights, then poison them
        r = miles_check_weights(c, "snapshot")
        assert r.status_code == 200 and r.json()["success"], r.text
        before = miles_engine_checksums(miles_check_weights(c, "checksum").json())
        assert len(before) == len(w1) and all(k.startswith("rank0/") for k in before)
        r = miles_check_weights(c, "reset_tensors")
        assert r.status_code == 200, r.text
        out = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "stale" in out["meta_info"]["finish_reason"]["message"]
        r = miles_check_weights(c, "compare")
        assert r.status_code == 400 and not r.json()["success"]
        assert "check tensor equality failed" in r.json()["message"]
        assert "name=model.norm.weight " in r.json()["message"]

        # a partial update leaves the rest unwritten: still not served
        end = miles_update(c, w1[:3], "partial")
        assert end["result"]["weights_stale"] is True
        assert end["result"]["weights_missing"] == len(w1) - 3
        # the first full update, then compare (train.py): equal to the snapshot
        end = miles_update(c, w1, "1")
        assert end["result"]["weights_stale"] is False
        r = miles_check_weights(c, "compare")
        assert r.status_code == 200 and r.json()["success"], r.text
        assert miles_engine_checksums(miles_check_weights(c, "checksum").json()) == before
        assert engine.generate(input_ids=PROMPTS[1], sampling_params=greedy)["output_ids"] \
            == want

        # other weights: compare fails naming them, the checksums change
        miles_update(c, w2, "2")
        r = miles_check_weights(c, "compare")
        assert r.status_code == 400 and "name=model.norm.weight " in r.json()["message"]
        after = miles_engine_checksums(miles_check_weights(c, "checksum").json())
        changed = {k for k in before if before[k] != after[k]}
        assert changed == {f"rank0/{n}" for n, t in w1 if not torch.equal(t, dict(w2)[n])}

        # skip_tensor_list: a difference there is tolerated, reset leaves it alone
        norm = "model.norm.weight"
        miles_update(c, [(n, dict(w2)[n] if n == norm else t) for n, t in w1], "3")
        r = miles_check_weights(c, "compare", skip_list=[norm])
        assert r.status_code == 200 and r.json()["result"]["tolerated"][0].startswith(
            f"name={norm} ")
        r = miles_check_weights(c, "compare")
        assert r.status_code == 400 and r.json()["message"].count("name=") == 1
        r = miles_check_weights(c, "reset_tensors", skip_list=[norm])
        assert r.status_code == 200
        assert engine.get_weights_by_name(norm, truncate_size=4) == \
            dict(w2)[norm][:4].tolist()
        miles_update(c, w1, "4")
        assert miles_check_weights(c, "compare").status_code == 200
    assert engine.generate(input_ids=PROMPTS[1], sampling_params=greedy)["output_ids"] == want


def test_session_and_checker_misuse_is_400(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/end_weight_update", json={})
        assert r.status_code == 400 and "no weight-update session" in r.json()["message"]
        assert c.post("/begin_weight_update", json={"selector": "target"}).status_code == 200
        r = c.post("/begin_weight_update", json={})
        assert r.status_code == 400 and "already open" in r.json()["message"]
        assert c.post("/end_weight_update", json={}).json()["result"]["selector"] == "target"
        r = c.post("/begin_weight_update", json={"selector": "both"})
        assert r.status_code == 400 and "selector" in r.json()["message"]
        r = miles_check_weights(c, "inspect")
        assert r.status_code == 400 and "action" in r.json()["message"]
        r = miles_check_weights(c, "compare", selector="draft")   # no draft: nothing to check
        assert r.status_code == 200 and r.json()["result"]["roles"] == []
        r = c.post("/weights_checker", json={"action": "checksum", "bogus": 1})
        assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
