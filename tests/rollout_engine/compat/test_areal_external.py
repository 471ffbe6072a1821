"""AReaL's external-server mode, replayed against two of our servers.

AReaL no longer starts ``sglang.launch_server``: its launcher runs its own wrapper,
``python -m areal.experimental.inference_service.sglang.launch_server`` (SGLang's launch flow
plus AReaL's ``/awex/*`` routes; ``SGLangConfig.build_cmd_from_args``). A server AReaL did not
start is used by naming it in ``AREAL_LLM_SERVER_ADDRS`` (``host:port`` entries joined by
commas): ``RemoteInfEngine.initialize`` reads it when no address is passed and name_resolve
has none, waits until ``GET /health`` answers 200 on each, and then talks plain SGLang HTTP. So
our server stands in for the wrapper as it is: ``python -m rollout_engine.launch_server
--model-path M --host H --port P``, then ``AREAL_LLM_SERVER_ADDRS=H:P,...``.

The trainer below (``_trainer_main``, run as ``python this_file.py URLS...``) makes the calls
AReaL's trainer makes, with its payloads, read from AReaL of 2026-05:

    addresses   AREAL_LLM_SERVER_ADDRS.split(","); GET /health on each until 200
                (areal/infra/remote_inf_engine.py initialize, _wait_for_server)
    connect     POST /init_weights_update_group to server i {master_address,
                master_port: str(port) (a string), rank_offset: 1 + i * tp_size * pp_size,
                world_size: gen world size + 1, backend, group_name: "update_weight_group"}
                while rank 0 joins with init_custom_process_group (tcp rendezvous,
                PrefixStore(group_name)) (areal/engine/sglang_remote.py
                build_init_weights_group_request, areal/engine/fsdp_engine.py
                _init_weight_update_from_distributed, areal/engine/core/distributed.py)
    update      POST /pause_generation {} to every server; per bucket POST
                /update_weights_from_distributed {names, dtypes: str(dtype) without "torch.",
                shapes, group_name, abort_all_requests: true} to every server while
                dist.broadcast(tensor, src=0, async_op=True) per tensor; POST
                /continue_generation {} (fsdp_engine._update_weights_from_distributed)
    generate    POST /generate {input_ids, image_data: null, sampling_params: {top_p, top_k,
                max_new_tokens, temperature, stop_token_ids, ignore_eos, skip_special_tokens,
                frequency_penalty}, return_logprob: true, stream: false}; reads
                meta_info.finish_reason.type and output_token_logprobs (build_generation_request,
                parse_generation_response)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

GROUP = "update_weight_group"


# -- the trainer, as AReaL's FSDP engine and remote SGLang backend write it --------------------
def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: datetime.timedelta) -> Any:
    """areal.engine.core.distributed.init_custom_process_group, for a tcp init_method."""
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
                                      timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _request(addr: str, endpoint: str, payload: Any = None, method: str = "POST") -> Any:
    """arequest_with_retry's one attempt: raise_for_status, then the JSON answer."""
    data = None if method == "GET" else json.dumps(payload).encode()
    req = urllib.request.Request(f"http://{addr}{endpoint}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _on_all(addrs: list[str], make: Any) -> list[Any]:
    """asyncio.gather of one request per server: each server's answer (the first error is
    raised, as gather raises it)."""
    with ThreadPoolExecutor(len(addrs)) as pool:
        futures = [pool.submit(make, i, addr) for i, addr in enumerate(addrs)]
    return [f.result() for f in futures]


def _trainer_main(checkpoint: str) -> None:
    from safetensors.torch import load_file

    addrs = os.environ["AREAL_LLM_SERVER_ADDRS"].split(",")
    for addr in addrs:                                    # _wait_for_server
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{addr}/health", timeout=30).read()
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"{addr} never became healthy"
                time.sleep(0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tp_size = pp_size = 1
    gen_world_size = len(addrs) * tp_size * pp_size
    pool = ThreadPoolExecutor(1)   # the init requests are in flight while rank 0 joins
    joined: Future = pool.submit(_on_all, addrs, lambda i, addr: _request(
        addr, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": str(port),
            "rank_offset": 1 + i * tp_size * pp_size, "world_size": gen_world_size + 1,
            "backend": "gloo", "group_name": GROUP}))
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", gen_world_size + 1,
                                      0, GROUP, datetime.timedelta(seconds=30))
    for answer in joined.result():
        assert answer["success"], answer

    weights = sorted(load_file(f"{checkpoint}/model.safetensors").items())
    _on_all(addrs, lambda i, addr: _request(addr, "/pause_generation", {}))
    chunk = 64 << 10                                      # weight_chunked_mem_mb, scaled down
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in weights:
        size = t.numel() * t.element_size()
        if buckets[-1] and used + size > chunk:
            buckets.append([])
            used = 0
        buckets[-1].append((name, t))
        used += size
    for bucket in buckets:
        body = {"names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).split("torch.")[1] for _, t in bucket],
                "shapes": [list(tuple(t.shape)) for _, t in bucket],
                "group_name": GROUP, "abort_all_requests": True}
        sent: Future = pool.submit(_on_all, addrs, lambda i, addr, body=body: _request(
            addr, "/update_weights_from_distributed", body))
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in bucket]
        for h in handles:
            h.wait()
        for answer in sent.result():
            assert answer["success"], answer
    _on_all(addrs, lambda i, addr: _request(addr, "/continue_generation", {}))
    pool.shutdown()
    dist.destroy_process_group(group)
    print("trainer done")


if __name__ == "__main__":
    _trainer_main(sys.argv[1])
    sys.exit(0)


# -- the tests -----------------------------------------------------------------------------
import pytest  # noqa: E402  (the trainer above runs without pytest)

from tests.rollout_engine.engines import thread_engine  # noqa: E402

PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 12]]


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def areal_servers(w1_w2: tuple[str, str]) -> Any:
    """Two servers on W1, as an operator starts them for AReaL's external mode."""
    import uvicorn

    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app
    from tests.rollout_engine.entrypoints.conftest import bound_socket

    served = []
    for _ in range(2):
        engine = Engine(model_path=w1_w2[0], scheduler_mode="thread", dtype="float32",
                        device="cpu", weight_update_group_timeout=60)
        sock = bound_socket()
        sock.listen(64)   # connections wait in the backlog until uvicorn serves
        server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning",
                                               access_log=False, timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        served.append((engine, server, thread, f"127.0.0.1:{sock.getsockname()[1]}"))
    yield [(engine, addr) for engine, _, _, addr in served]
    for engine, server, thread, _ in served:
        server.should_exit = True
        thread.join(10)
        engine.check_integrity()
        engine.shutdown()


def _areal_generate(addr: str, input_ids: list[int], eos: int) -> dict[str, Any]:
    """SGLangBackend.build_generation_request for a greedy text request."""
    payload = {"input_ids": list(input_ids), "image_data": None,
               "sampling_params": {"top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
                                   "temperature": 0.0, "stop_token_ids": [eos],
                                   "ignore_eos": False, "skip_special_tokens": True,
                                   "frequency_penalty": 0.0},
               "return_logprob": True, "stream": False}
    return _request(addr, "/generate", payload)


def test_areal_external_mode_refits_every_server(areal_servers: Any,
                                                  w1_w2: tuple[str, str]) -> None:
    addrs = [addr for _, addr in areal_servers]
    reference = []
    for ref in thread_engine(w1_w2[1]):
        eos = ref.tokenizer.eos_token_id
        reference = [ref.generate(input_ids=ids, return_logprob=True, sampling_params={
            "max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [eos]})
            for ids in PROMPTS]
    env = {**os.environ, "AREAL_LLM_SERVER_ADDRS": ",".join(addrs)}
    proc = subprocess.run([sys.executable, __file__, w1_w2[1]], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer done" in proc.stdout
    for engine, addr in areal_servers:
        for ids, want in zip(PROMPTS, reference):
            out = _areal_generate(addr, ids, eos)
            meta = out["meta_info"]        # parse_generation_response
            assert meta["finish_reason"]["type"] in ("stop", "length")
            assert [x[1] for x in meta["output_token_logprobs"]] == want["output_ids"]
            got = [x[0] for x in meta["output_token_logprobs"]]
            assert got == pytest.approx(
                [x[0] for x in want["meta_info"]["output_token_logprobs"]], abs=1e-4)
        assert engine.get_server_info()["paused"] is False
