"""Per-request weight version spans (vLLM's ``WeightVersionSpan``): the final output's
``meta_info["weight_versions"]`` covers every output token, one span per label change, on
``Engine.generate`` and ``/generate`` alike."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.request import Req
from tests.rollout_engine.vllm.control_server import (
    PROMPTS,
    greedy,
    tokens_so_far,
    w1_w2,
    wait_running,
)

N = 200


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from tests.rollout_engine.engines import thread_engine

    yield from thread_engine(w1_w2()[0])


def test_spans_start_a_new_label_only_where_it_changes() -> None:
    req = Req(GenerateReq("r", [1, 2], SamplingParams(), seed=0), arrival=0)
    for token, label in zip(range(7), ["a", "a", "b", "b", "b", "a", "a"]):
        req.append_output(token)
        req.see_weight_version(label)
    assert [s.to_dict() for s in req.weight_spans()] == [
        {"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 5},
        {"version": "a", "start": 5, "end": 7}]
    assert req.weight_starts == [("a", 0), ("b", 2), ("a", 5)]   # one entry per change
    assert Req(GenerateReq("q", [1], SamplingParams(), seed=0), 1).weight_spans() == []


def test_a_relabel_mid_request_splits_its_span_at_that_token(engine) -> None:
    box: dict[str, Any] = {}

    def run() -> None:
        for chunk in engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(N),
                                     stream=True, rid="relabelled"):
            box["final"] = chunk

    t = threading.Thread(target=run)
    t.start()
    wait_running(engine, 1)
    engine.pause_generation("in_place")
    k = tokens_so_far(engine, "relabelled")
    engine.update_weight_version("v2", abort_all_requests=False)
    engine.continue_generation()
    t.join(60)
    try:
        meta = box["final"]["meta_info"]
        assert 0 < k < N
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": k},
                                           {"version": "v2", "start": k, "end": N}]
        plain = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(5))
        assert plain["meta_info"]["weight_versions"] == [
            {"version": "v2", "start": 0, "end": 5}]
        assert plain["meta_info"]["weight_version"] == "v2"
    finally:
        engine.update_weight_version("default", abort_all_requests=False)


def test_generate_route_and_a_batch_carry_spans(engine) -> None:
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as client:
        r = client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy(4)})
    assert r.status_code == 200, r.text
    for out in r.json():
        assert out["meta_info"]["weight_versions"] == [
            {"version": "default", "start": 0, "end": 4}]
    zero = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 0})
    assert zero["meta_info"]["weight_versions"] == []
