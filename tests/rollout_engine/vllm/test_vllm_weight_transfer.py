"""vLLM's native weight transfer over gloo: init -> start -> update (per tensor, packed) ->
finish from a trainer thread (trainer_bridge.vllm_transfer), against a live server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rollout_engine.protocol.vllm_wire import packed_chunks
from tests.rollout_engine.entrypoints.conftest import LiveServer
from tests.rollout_engine.vllm.weight_server import (
    GREEDY,
    checkpoints,
    fresh_greedy,
    greedy,
    live_server,
)
from trainer_bridge.transports.group_ranks import free_port
from trainer_bridge.vllm_transfer import VllmTransferError, VllmWeightSender


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from rollout_engine.weights.loader import safetensors_files

    out: list[tuple[str, torch.Tensor]] = []
    for f in safetensors_files(path):
        out.extend(sorted(load_file(f).items()))
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(checkpoints()[0], scheduler_mode="process") as s:
        yield s


@pytest.fixture(scope="module")
def expected() -> dict[str, list[list[int]]]:
    w1, w2 = checkpoints()
    return {"w1": fresh_greedy(w1), "w2": fresh_greedy(w2)}


@pytest.fixture
def sender(server: LiveServer) -> Iterator[VllmWeightSender]:
    s = VllmWeightSender(server.url, master_port=free_port(), packed_buffer_size_bytes=4096)
    s.init()
    try:
        yield s
    finally:
        s.shutdown()


def version(server: LiveServer) -> Any:
    with server.client() as c:
        return c.get("/get_weight_version").json()["weight_version"]


def test_packed_chunks_follow_vllms_rule() -> None:
    # a chunk closes on the tensor that takes it past the limit
    assert packed_chunks([4, 4, 4, 4], 6) == [range(0, 2), range(2, 4)]
    assert packed_chunks([4, 4, 4], 8) == [range(0, 3)]
    assert packed_chunks([10, 1], 4) == [range(0, 1), range(1, 2)]
    assert packed_chunks([], 4) == []


@pytest.mark.parametrize("packed, updates", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_transfer_equals_a_fresh_engine(server: LiveServer, sender: VllmWeightSender,
                                        expected: dict, packed: bool, updates: int) -> None:
    w1, w2 = checkpoints()
    assert greedy(server) == expected["w1"]
    sender.send(checkpoint_tensors(w2), weight_version=f"w2-{packed}-{updates}",
                packed=packed, updates=updates)
    assert greedy(server) == expected["w2"]
    assert version(server) == f"w2-{packed}-{updates}"
    sender.send(checkpoint_tensors(w1), weight_version="w1", packed=packed, updates=updates)
    assert greedy(server) == expected["w1"]
    server.assert_no_leak()


def test_nothing_is_served_before_finish(server: LiveServer, sender: VllmWeightSender,
                                         expected: dict) -> None:
    w2 = checkpoints()[1]
    sender.post("/start_weight_update")
    sender.update(checkpoint_tensors(w2), packed=True)
    assert greedy(server) == expected["w1"]   # received, not yet applied
    sender.post("/finish_weight_update", {"weight_version": "w2"})
    assert greedy(server) == expected["w2"]
    sender.send(checkpoint_tensors(checkpoints()[0]), weight_version="w1")


def bad_updates() -> list[tuple[str, Any]]:
    return [
        ("unknown name", lambda n, t: (n + ".extra", t) if n.endswith("norm.weight") else (n, t)),
        ("shape", lambda n, t: (n, t[:-1]) if n.endswith("q_proj.weight") else (n, t)),
        ("dtype", lambda n, t: (n, t.to(torch.int32)) if n.endswith("norm.weight") else (n, t)),
    ]


@pytest.mark.parametrize("what, change", bad_updates(), ids=[b[0] for b in bad_updates()])
@pytest.mark.parametrize("packed", [False, True])
def test_bad_update_is_refused_and_nothing_changes(server: LiveServer,
                                                   sender: VllmWeightSender, expected: dict,
                                                   what: str, change: Any,
                                                   packed: bool) -> None:
    w2 = checkpoints()[1]
    before = version(server)
    tensors = checkpoint_tensors(w2)
    good, bad = tensors[: len(tensors) // 2], [change(n, t) for n, t in tensors]
    sender.post("/start_weight_update")
    sender.update(good, packed=packed)            # a first chunk arrives fine
    with pytest.raises(VllmTransferError) as e:
        sender.update(bad, packed=packed)          # drained, then refused
    assert e.value.status == 400
    # the refusal ended the update: nothing of it is applied
    with pytest.raises(VllmTransferError, match="start_weight_update"):
        sender.post("/finish_weight_update", {"weight_version": "bad"})
    assert greedy(server) == expected["w1"]
    assert version(server) == before
    # and the group still works
    sender.send(tensors, weight_version="w2", packed=packed)
    assert greedy(server) == expected["w2"]
    sender.send(checkpoint_tensors(checkpoints()[0]), weight_version="w1")


def test_phases_out_of_order_are_refused(server: LiveServer) -> None:
    with server.client() as c:
        for path in ("/start_weight_update", "/finish_weight_update"):
            r = c.post(path)
            assert r.status_code == 400, r.text
            assert "init_weight_transfer_engine" in r.json()["error"]["message"]
        r = c.post("/update_weights", json={"update_info": {"names": []}})
        assert r.status_code == 400
        r = c.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}})
        assert r.status_code == 400 and "master_address" in r.json()["error"]["message"]
        r = c.post("/init_weight_transfer_engine", json={"init_info": {"bogus": 1}})
        assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]


def test_update_races_generation(server: LiveServer, sender: VllmWeightSender,
                                 expected: dict) -> None:
    """Requests running while the weights arrive and are applied all finish; afterwards the
    server answers as the new weights do."""
    w1, w2 = checkpoints()
    results: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with server.client() as c:
            while not stop.is_set():
                r = c.post("/generate", json={"input_ids": [3, 1, 4, 1, 5],
                                              "sampling_params": {**GREEDY,
                                                                  "max_new_tokens": 24}})
                results.append(r.status_code)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for packed in (False, True):
            sender.send(checkpoint_tensors(w2), weight_version="w2", packed=packed, updates=2)
            sender.send(checkpoint_tensors(w1), weight_version="w1", packed=packed, updates=2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert results and set(results) == {200}
    assert greedy(server) == expected["w1"]
    server.assert_no_leak()


def test_world_size(server: LiveServer) -> None:
    with server.client() as c:
        assert c.get("/get_world_size").json() == {"world_size": 1}
        assert c.get("/get_world_size", params={"include_dp": "false"}).json() == \
            {"world_size": 1}
        r = c.get("/get_world_size", params={"include_dp": "maybe"})
        assert r.status_code == 400 and "include_dp" in r.json()["error"]["message"]


def vllm_python() -> str:
    """vLLM 0.32's venv (``$ROLLOUT_VLLM_VENV``, else the repository's ``.vllm-venv``: what
    benchmarks/vllm_peer.py installs)."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    py = Path(os.environ.get("ROLLOUT_VLLM_VENV", repo / ".vllm-venv")) / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import vllm"],
                                         capture_output=True).returncode:
        pytest.skip(f"vLLM's venv is not installed at {py.parent.parent} "
                    "(benchmarks/vllm_peer.py installs it)")
    return str(py)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_vllms_own_trainer_sender(server: LiveServer, expected: dict, packed: bool) -> None:
    """vLLM's NCCLTrainerWeightTransferEngine.send_weights and HTTPVLLMWeightSyncClient,
    run in vLLM's venv, refit the server: its handshake, update_info and broadcast order /
    packing are what this server reads (only the communicator is gloo: no CUDA here)."""
    import json
    import subprocess
    from pathlib import Path

    from rollout_engine.weights.loader import safetensors_files

    py = vllm_python()
    w1, w2 = checkpoints()
    repo = str(Path(__file__).resolve().parents[3])
    for path, want in ((w2, "w2"), (w1, "w1")):
        (checkpoint,) = safetensors_files(path)
        args = {"repo": repo, "url": server.url, "port": free_port(), "checkpoint": checkpoint,
                "packed": packed, "buffer": 4096}
        run = subprocess.run([py, str(Path(__file__).parent / "vllm_trainer_script.py"),
                              json.dumps(args)], capture_output=True, text=True, timeout=300,
                             env={**__import__("os").environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        assert run.returncode == 0, run.stderr[-3000:]
        assert greedy(server) == expected[want]


def test_a_second_init_replaces_the_group(server: LiveServer, sender: VllmWeightSender,
                                          expected: dict) -> None:
    """A restarted trainer inits again (vLLM replaces its communicator): the new group is the
    one updates arrive on."""
    w1, w2 = checkpoints()
    again = VllmWeightSender(server.url, master_port=free_port(), packed=True,
                             packed_buffer_size_bytes=4096)
    again.init()
    try:
        again.send(checkpoint_tensors(w2), weight_version="w2")
        assert greedy(server) == expected["w2"]
        again.send(checkpoint_tensors(w1), weight_version="w1")
    finally:
        again.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_transfer_over_vllms_nccl_rendezvous(packed: bool) -> None:
    """On CUDA both sides meet through vLLM's rendezvous and NCCL (protocol/vllm_nccl.py).
    NCCL wants one device per rank: the engine on GPU 0, the trainer on GPU 1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one NCCL rank each)")
    w1, w2 = checkpoints()
    want = fresh_greedy(w2)
    with live_server(w1, device="cuda", scheduler_mode="process") as cuda_server, \
            torch.cuda.device(1):
        s = VllmWeightSender(cuda_server.url, master_port=free_port(), packed=packed,
                             packed_buffer_size_bytes=4096)
        assert s.backend == "nccl"
        s.init()
        try:
            s.send([(n, t.cuda()) for n, t in checkpoint_tensors(w2)], weight_version="w2")
            assert greedy(cuda_server) == want
        finally:
            s.shutdown()
