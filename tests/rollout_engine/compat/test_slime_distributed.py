"""A trainer process written the way slime refits SGLang over a process group, against our
server; and our group join checked against torch's own group helper (what SGLang runs).

The trainer (`_trainer_main`, run as ``python this_file.py ...``) reimplements, from reading
slime (``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``,
``slime/utils/distributed_utils.py``, ``slime/backends/sglang_utils/sglang_engine.py``):

    connect     POST /init_weights_update_group {master_address, master_port, rank_offset: 1,
                world_size, group_name: "slime-pp_0", backend} (slime fires it, then joins)
                + init_process_group(backend, "tcp://addr:port", world_size, rank=0, group_name)
                  = rendezvous -> PrefixStore(group_name) -> torch's _new_process_group_helper
    update      POST /pause_generation, GET /flush_cache; per bucket of
                update_weight_buffer_size bytes: POST /update_weights_from_distributed
                {names, dtypes: str(dtype) without "torch.", shapes, group_name, flush_cache:
                false, weight_version: str(step)} while dist.broadcast(param, 0, group,
                async_op=True) for each tensor; POST /continue_generation
    disconnect  POST /destroy_weights_update_group + dist.destroy_process_group(group)

and, for ``load_format="flattened_bucket"``, what SGLang's engine receives
(``model_runner._update_bucketed_weights_from_distributed``): one broadcast of a
``FlattenedTensorBucket``, the tensors' bytes back to back.
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import torch
import torch.distributed as dist

GROUP = "slime-pp_0"
PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 12]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


# -- the trainer, as slime writes it ---------------------------------------------------------
def init_process_group(backend: str, init_method: str, world_size: int, rank: int,
                       group_name: str, timeout: datetime.timedelta) -> Any:
    """slime.utils.distributed_utils.init_process_group (= SGLang's init_custom_process_group)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _post(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a JSON body; the answer with its HTTP status under "http_status"."""
    req = urllib.request.Request(f"{url}{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return {"http_status": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, **json.loads(e.read())}


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=fn(*args)), daemon=True)
    t.start()
    return t, box


def _buckets(tensors: list[tuple[str, torch.Tensor]], buffer_size: int) -> list[list[Any]]:
    """slime's _iter_non_expert_chunks: fill a bucket until the next tensor would overflow."""
    out: list[list[Any]] = [[]]
    used = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and used + nbytes > buffer_size:
            out.append([])
            used = 0
        out[-1].append((name, t))
        used += nbytes
    return out


def _trainer_main(url: str, checkpoint: str, mode: str, step: str) -> None:
    from safetensors.torch import load_file

    weights = sorted(load_file(f"{checkpoint}/model.safetensors").items())
    if mode == "bf16-per-tensor":      # Megatron's bf16 params, one broadcast per tensor
        weights = [(n, t.to(torch.bfloat16)) for n, t in weights]
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    world_size = 2
    t, box = _in_thread(_post, url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": world_size, "group_name": GROUP, "backend": "gloo"})
    group = init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0, GROUP,
                               datetime.timedelta(seconds=60))
    t.join()
    assert box["r"]["success"], box

    assert _post(url, "/pause_generation", {})["http_status"] == 200   # raise_for_status
    urllib.request.urlopen(f"{url}/flush_cache", timeout=60).read()
    for bucket in _buckets(weights, 40 << 10):
        body = {"names": [n for n, _ in bucket],
                "dtypes": [str(p.dtype).replace("torch.", "") for _, p in bucket],
                "shapes": [list(p.shape) for _, p in bucket],
                "group_name": GROUP, "flush_cache": False, "weight_version": step}
        if mode == "flattened":
            body["load_format"] = "flattened_bucket"
        t, box = _in_thread(_post, url, "/update_weights_from_distributed", body)
        if mode == "flattened":     # FlattenedTensorBucket: uint8 views, concatenated
            flat = torch.cat([p.flatten().view(torch.uint8) for _, p in bucket])
            dist.broadcast(flat, 0, group=group)
        else:
            handles = [dist.broadcast(p.data, 0, group=group, async_op=True) for _, p in bucket]
            for h in handles:
                h.wait()
        t.join()
        assert box["r"]["success"], box
    assert _post(url, "/continue_generation", {})["http_status"] == 200
    assert _post(url, "/destroy_weights_update_group", {"group_name": GROUP})["success"]
    dist.destroy_process_group(group)
    print("trainer done")


if __name__ == "__main__":
    _trainer_main(*sys.argv[1:5])
    sys.exit(0)


# -- the tests -----------------------------------------------------------------------------
import pytest  # noqa: E402  (the trainer above runs without pytest)


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def served(w1_w2):
    """A thread-mode fp32 engine on W1 behind our HTTP server (uvicorn in a thread)."""
    import uvicorn

    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    engine = Engine(model_path=w1_w2[0], scheduler_mode="thread", dtype="float32",
                    device="cpu", weight_update_group_timeout=60)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    engine.check_integrity()
    engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollouts(engine) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in PROMPTS:
        o = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        out.append((o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]))
    return out


def _engine_weights(engine, names_like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(engine.get_weights_by_name(n, truncate_size=max(1, t.shape[0])),
                            dtype=torch.float32) for n, t in names_like.items()}


def _run_trainer(url: str, checkpoint: str, mode: str, step: str) -> None:
    r = subprocess.run([sys.executable, __file__, url, checkpoint, mode, step],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "trainer done" in r.stdout, r.stdout + r.stderr


def test_a_slime_trainer_refits_our_server(served, w1_w2):
    from rollout_engine import Engine
    from rollout_engine.weights.loader import iter_safetensors

    engine, url = served
    w2 = dict(iter_safetensors(w1_w2[1]))
    with Engine(model_path=w1_w2[1], scheduler_mode="thread", dtype="float32",
                device="cpu") as reference:
        expected = _rollouts(reference)
    assert _rollouts(engine) != expected

    # bf16 Megatron params, one broadcast each: received as bf16, cast into the fp32 weights
    _run_trainer(url, w1_w2[1], "bf16-per-tensor", "1")
    got = _engine_weights(engine, w2)
    for name, t in w2.items():
        assert torch.equal(got[name], t.to(torch.bfloat16).float()), name
    assert engine.get_weight_version() == "1"

    # fp32, SGLang's flattened buckets; the same group name joined again after the destroy
    _run_trainer(url, w1_w2[1], "flattened", "2")
    got = _engine_weights(engine, w2)
    for name, t in w2.items():
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name  # bits
    assert engine.get_weight_version() == "2"
    assert _rollouts(engine) == expected        # tokens and logprobs, exactly
    info = engine.get_server_info()
    assert not info["pending_weight_update_groups"]


# -- our join against torch's helper itself --------------------------------------------------
def _torch_helper_side(port: int, rank: int, world_size: int, name: str,
                       timeout_s: float = 30) -> Any:
    return init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, rank, name,
                              datetime.timedelta(seconds=timeout_s))


@pytest.mark.parametrize("ours", [1, 0], ids=["engine-side", "trainer-side"])
def test_our_join_meets_torchs_helper(ours):
    """Rank `ours` joins with join_update_group, the other rank with torch's
    _new_process_group_helper (as SGLang's engine / slime's trainer do), in one process."""
    from rollout_engine.protocol.weight_broadcast import join_update_group

    port, name = _free_port(), f"layout-check-{ours}"
    t, box = _in_thread(join_update_group, "127.0.0.1", port, ours, 2, name, "gloo", 30)
    theirs = _torch_helper_side(port, 1 - ours, 2, name)
    t.join(60)
    group = box["r"]
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    received = torch.zeros(3, 4)
    if ours == 0:
        work = group.broadcast(sent)
        dist.broadcast(received, 0, group=theirs)
    else:
        work = group.broadcast(received)
        dist.broadcast(sent, 0, group=theirs)
    work.wait()
    assert torch.equal(received, sent)
    group.shutdown()
    dist.destroy_process_group(theirs)


def test_a_missing_engine_is_named(make_engine, qwen2_path):
    """A world of 3 whose second engine never comes: our engine's join gives up after its
    weight_update_group_timeout and names engine rank 2 (and why rank 0 looks missing too:
    slime's trainer waits in the rendezvous until all 3 ranks have connected)."""
    engine = make_engine(qwen2_path, weight_update_group_timeout=2.0)
    port = _free_port()
    trainer, box = _in_thread(_expect_timeout, port, "g-missing")
    start = time.monotonic()
    ok, msg = engine.init_weights_update_group("127.0.0.1", port, 1, 3, group_name="g-missing",
                                               backend="gloo")
    assert not ok
    assert "engine rank 2" in msg and "the trainer (rank 0)" in msg, msg
    assert "did not all join within 2 s" in msg, msg
    assert time.monotonic() - start < 20
    trainer.join(30)
    assert box["r"] != "joined", box     # the trainer timed out as well
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]


def _expect_timeout(port: int, name: str) -> str:
    try:
        _torch_helper_side(port, 0, 3, name, timeout_s=4)
    except Exception as e:  # noqa: BLE001 - the expected rendezvous timeout
        return str(e)
    return "joined"
