"""SkyRL's weight sync against the vLLM face: its own client and broadcast sender, run from a
venv with the ``skyrl`` package (skyrl_sync_script.py says what is stubbed), and a replay of
the same calls from its call sites (remote_inference_client.py, broadcast_strategy.py).

    GET  /get_world_size (a JSON body of {})           world size per server
    POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
         rank_offset, world_size}}                      beside the trainer's rank-0 join
    POST /collective_rpc skyrl_start_weight_update {is_checkpoint_format: true}
    POST /collective_rpc update_weights_nccl {update_info: {names, dtype_names, shapes,
         packed: true}}                                 beside vLLM's packed broadcast
    POST /collective_rpc skyrl_finish_weight_update
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout_engine.protocol.weight_broadcast import join_update_group
from tests.rollout_engine.entrypoints.conftest import LiveServer
from tests.rollout_engine.vllm.test_vllm_weight_transfer import checkpoint_tensors
from tests.rollout_engine.vllm.weight_server import checkpoints, fresh_greedy, greedy, live_server
from trainer_bridge.transports.group_ranks import free_port
from trainer_bridge.vllm_transfer import VLLM_GROUP, broadcast_weights, update_info


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(checkpoints()[0]) as s:
        yield s


def rpc(c, method: str, **kwargs):
    body = {"method": method, **({"kwargs": kwargs} if kwargs else {})}
    return c.post("/collective_rpc", json=body)


def test_skyrl_broadcast_sync(server: LiveServer) -> None:
    w1, w2 = checkpoints()
    expected = fresh_greedy(w2)
    assert greedy(server) != expected
    port = free_port()
    with server.client(timeout=120) as c, ThreadPoolExecutor(1) as pool:
        r = c.request("GET", "/get_world_size", json={})
        assert r.status_code == 200 and r.json() == {"world_size": 1}
        world_size = r.json()["world_size"] + 1   # + the trainer's rank 0
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                     "world_size": world_size}
        answer = pool.submit(c.post, "/init_weight_transfer_engine", json={"init_info": init_info})
        group = join_update_group("127.0.0.1", port, 0, world_size, VLLM_GROUP, "gloo", 60.0)
        assert answer.result().status_code == 200, answer.result().text
        try:
            r = rpc(c, "skyrl_start_weight_update", is_checkpoint_format=True)
            assert r.status_code == 200 and r.json() == {"results": [None]}, r.text
            named = checkpoint_tensors(w2)
            answer = pool.submit(rpc, c, "update_weights_nccl",
                                 update_info={**update_info(named), "packed": True})
            broadcast_weights(group, named, packed=True)   # vLLM's default buffer: one chunk
            assert answer.result().status_code == 200, answer.result().text
            assert greedy(server) != expected   # not before the finish
            r = rpc(c, "skyrl_finish_weight_update")
            assert r.status_code == 200, r.text
            assert greedy(server) == expected
        finally:
            assert c.post("/shutdown_weight_transfer_engine").status_code == 200
            group.shutdown()
        assert c.post("/update_weights", json={"weight_dir": w1}).status_code == 200
    server.assert_no_leak()


SKYRL = ["skyrl==0.3.0", "aiohttp", "aiohappyeyeballs", "aiosignal", "frozenlist", "multidict",
         "propcache", "yarl"]
"""skyrl without its training stack (torch, safetensors and the rest come from the system)."""


@pytest.mark.slow   # the real client in its venv; its calls replayed below
def test_skyrl_client_and_sender(server: LiveServer) -> None:
    import json
    import subprocess
    from pathlib import Path

    from rollout_engine.weights.loader import safetensors_files
    from tests.venvs import client_venv

    py = client_venv("skyrl-venv", SKYRL, system_site_packages=True, no_deps=True)
    repo = Path(__file__).resolve().parents[3]
    w1, w2 = checkpoints()
    expected = fresh_greedy(w2)
    assert greedy(server) != expected
    (checkpoint,) = safetensors_files(w2)
    args = {"repo": str(repo), "url": server.url, "checkpoint": checkpoint}
    run = subprocess.run([str(py), str(Path(__file__).parent / "skyrl_sync_script.py"),
                          json.dumps(args)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "synced" in run.stdout
    assert greedy(server) == expected
    with server.client() as c:   # back to W1 for the other tests
        assert c.post("/update_weights", json={"weight_dir": w1}).status_code == 200
    server.assert_no_leak()


@pytest.mark.parametrize("body, named", [
    ({"method": "eval", "args": ["1"]}, "'eval'"),
    ({"method": "__init__"}, "'__init__'"),
    ({"method": "update_weights_nccl", "kwargs": {"bogus": 1}}, "bogus"),
    ({"method": "update_weights_ipc", "kwargs": {"bogus": 1}}, "bogus"),
    ({"args": []}, "method"),
])
def test_other_methods_are_refused(server: LiveServer, body: dict, named: str) -> None:
    with server.client() as c:
        r = c.post("/collective_rpc", json=body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
