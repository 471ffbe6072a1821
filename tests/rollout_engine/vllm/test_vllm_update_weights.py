"""prime-rl's filesystem refit: ``POST /update_weights {"weight_dir": DIR}`` (its client's body
and the ``{"status": "ok"}`` it reads), and the body dispatch of the route vLLM's native
transfer shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.rollout_engine.entrypoints.conftest import LiveServer
from tests.rollout_engine.vllm.weight_server import checkpoints, fresh_greedy, greedy, live_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(checkpoints()[0]) as s:
        yield s


def test_weight_dir_loads_the_checkpoint(server: LiveServer) -> None:
    w1, w2 = checkpoints()
    before = greedy(server)
    expected = fresh_greedy(w2)
    assert before != expected   # the two checkpoints answer differently
    with server.client() as c:
        r = c.post("/update_weights", json={"weight_dir": w2})
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ok"}
    assert greedy(server) == expected
    with server.client() as c:   # and back: prime-rl refits every step
        assert c.post("/update_weights", json={"weight_dir": w1}).status_code == 200
    assert greedy(server) == before
    server.assert_no_leak()


@pytest.mark.parametrize("body, named", [
    ({}, ["weight_dir", "update_info", "neither"]),
    ({"weight_dir": "/x", "update_info": {}}, ["weight_dir", "update_info", "both"]),
    ({"weight_dir": None}, ["weight_dir"]),
    ({"weight_dir": "/x", "extra": 1}, ["extra"]),
])
def test_body_must_name_one_transport(server: LiveServer, body: dict, named: list[str]) -> None:
    with server.client() as c:
        r = c.post("/update_weights", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for word in named:
        assert word in message


def test_missing_directory_is_refused_and_nothing_changes(server: LiveServer,
                                                          tmp_path) -> None:
    before = greedy(server)
    with server.client() as c:
        r = c.post("/update_weights", json={"weight_dir": str(tmp_path / "nowhere")})
    assert r.status_code == 400, r.text
    assert "nowhere" in r.json()["error"]["message"]
    assert greedy(server) == before
