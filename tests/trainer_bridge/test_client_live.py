"""RolloutClient against a live server (create_app over the shared engine, uvicorn in a
thread): rollouts, and WeightSyncer / engine_sleeping driving the server through the client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.trainer_bridge.conftest import GREEDY, PROBE, PROMPTS, assert_same_rollouts
from tests.trainer_bridge.live_server import live_client
from trainer_bridge import RolloutClient, RolloutError, WeightSyncer, engine_sleeping


@pytest.fixture(scope="module")
def served(engine: Any) -> Iterator[tuple[RolloutClient, set[str]]]:
    with live_client(engine) as (client, routes):
        yield client, routes


def needs(routes: set[str], *paths: str) -> None:
    """The routes these tests drive must all be served (a missing one is a failure)."""
    missing = [p for p in paths if p not in routes]
    assert not missing, f"the server has no {', '.join(missing)}"


def client_rollouts(client: RolloutClient) -> list[Any]:
    out = []
    for ids in PROMPTS:
        (r,) = client.generate_batch([ids], GREEDY, n=1)
        out.append((r.output_ids, r.output_logprobs))
    return out


def test_rollouts_over_http(served, engine_on_w1, w1):
    client, _ = served
    assert client.health() and client.get_model_info()["weight_version"] == "w1"
    assert_same_rollouts(client_rollouts(client), w1.expected)  # same numbers as the Python Engine
    rollouts = client.generate_batch(PROMPTS, {"temperature": 1.0, "max_new_tokens": 4,
                                               "sampling_seed": 3}, n=3)
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [
        (p, s) for p in range(len(PROMPTS)) for s in range(3)]
    for r in rollouts:
        assert len(r.output_ids) == len(r.output_logprobs) == 4
        assert all(lp <= 0 for lp in r.output_logprobs) and r.weight_versions == ["w1"]
    assert client.get_weight_version() == "w1"
    assert "# TYPE" in client.metrics()
    with pytest.raises(RolloutError) as info:
        client.generate(input_ids=[1], sampling_params={"max_new_tokens": -1})
    assert info.value.status == 400 and "max_new_tokens" in info.value.message
    with pytest.raises(RolloutError) as info:
        RolloutClient(client.base_url, admin_api_key="wrong").flush_cache()
    assert info.value.status == 401


@pytest.mark.parametrize("transport,route", [
    ("tensor", "/update_weights_from_tensor"),
    ("distributed", "/update_weights_from_distributed"),
    ("disk", "/update_weights_from_disk")])
def test_weight_syncer_through_the_client(served, engine_on_w1, w2, transport, route):
    client, routes = served
    needs(routes, route, "/get_weights_by_name", "/init_weights_update_group",
          "/destroy_weights_update_group")
    with WeightSyncer(client, transport=transport, bucket_bytes=96 << 10) as syncer:
        report = syncer.sync(w2.model, version="http-1")
    assert report.version == client.get_weight_version() == "http-1"
    assert_same_rollouts(client_rollouts(client), w2.expected)
    assert client.get_weights_by_name(PROBE, 4) == w2.probe


def test_engine_sleeping_through_the_client(served, engine_on_w1, w2):
    client, routes = served
    needs(routes, "/release_memory_occupation", "/resume_memory_occupation",
          "/update_weights_from_tensor")
    with WeightSyncer(client, transport="tensor") as syncer:
        with engine_sleeping(client, syncer, w2.model, version="woke") as report:
            assert client.get_server_info()["released_memory"] != []
    assert report.bytes_freed > 0 and report.sync.version == "woke"
    assert_same_rollouts(client_rollouts(client), w2.expected)
