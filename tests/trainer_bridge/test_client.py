"""RolloutClient / AsyncRolloutClient against a mock transport: each method hits its route
with API.md's body, parses the answer, and turns error statuses into RolloutError."""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import os
from typing import Any

import httpx
import pytest
import torch

from rollout_engine.protocol.tensor_payload import deserialize_named_tensors
from trainer_bridge import AsyncRolloutClient, RolloutClient, RolloutError

OK = {"success": True, "message": "ok"}
LOADED = {"loaded_adapters": {"a": {"lora_name": "a", "version": 3}}}
GEN_OUT = {"text": "ab", "output_ids": [5, 6], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
    "weight_versions": ["3"], "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}

# (call, method, path, body the server must see (None: no body), answer, expected return)
ROUTES: list[tuple[Any, str, str, Any, Any, Any]] = [
    (lambda c: c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}),
     "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                           "return_logprob": False, "top_logprobs_num": 0,
                           "logprob_start_len": -1}, GEN_OUT, GEN_OUT),
    (lambda c: c.health(), "GET", "/health", None, {"status": "ok"}, True),
    (lambda c: c.health_generate(), "GET", "/health_generate", None, {"status": "ok"}, True),
    (lambda c: c.get_model_info(), "GET", "/get_model_info", None, {"model_path": "m"},
     {"model_path": "m"}),
    (lambda c: c.get_server_info(), "GET", "/get_server_info", None, {"paused": False},
     {"paused": False}),
    (lambda c: c.flush_cache(), "POST", "/flush_cache", None, OK, True),
    (lambda c: c.abort_request(abort_all=True), "POST", "/abort_request",
     {"rid": "", "abort_all": True}, OK, None),
    (lambda c: c.pause_generation("retract"), "POST", "/pause_generation", {"mode": "retract"},
     {**OK, "result": {"mode": "retract"}}, {"mode": "retract"}),
    (lambda c: c.continue_generation(), "POST", "/continue_generation", {},
     {**OK, "result": {"paused": False}}, {"paused": False}),
    (lambda c: c.release_memory_occupation(["kv_cache"]), "POST", "/release_memory_occupation",
     {"tags": ["kv_cache"]}, {**OK, "result": {"released": ["kv_cache"]}},
     {"released": ["kv_cache"]}),
    (lambda c: c.resume_memory_occupation(), "POST", "/resume_memory_occupation", {},
     {**OK, "result": {"released": []}}, {"released": []}),
    (lambda c: c.update_weights_from_disk("/ckpt", weight_version="7"), "POST",
     "/update_weights_from_disk", {"model_path": "/ckpt", "load_format": None,
                                   "weight_version": "7", "flush_cache": True,
                                   "abort_all_requests": False}, OK, (True, "ok")),
    (lambda c: c.init_weights_update_group("127.0.0.1", 29500, 1, 2, backend="gloo"), "POST",
     "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                    "rank_offset": 1, "world_size": 2,
                                    "group_name": "weight_update_group", "backend": "gloo"},
     OK, (True, "ok")),
    (lambda c: c.update_weights_from_distributed(["w"], [torch.bfloat16], [(2, 3)],
                                                 load_format="flattened_bucket"),
     "POST", "/update_weights_from_distributed",
     {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
      "group_name": "weight_update_group", "load_format": "flattened_bucket",
      "flush_cache": True, "weight_version": None}, {"success": False, "message": "no"},
     (False, "no")),
    (lambda c: c.destroy_weights_update_group(), "POST", "/destroy_weights_update_group",
     {"group_name": "weight_update_group"}, OK, (True, "ok")),
    (lambda c: c.get_weights_by_name("w", 2), "POST", "/get_weights_by_name",
     {"name": "w", "truncate_size": 2}, [[1.0, 2.0]], [[1.0, 2.0]]),
    (lambda c: c.get_weight_version(), "GET", "/get_weight_version", None,
     {"weight_version": "3"}, "3"),
    (lambda c: c.metrics(), "GET", "/metrics", None, "up 1\n", "up 1\n"),
    (lambda c: c.update_weight_version("4"), "POST", "/update_weight_version",
     {"new_version": "4"}, {**OK, "result": {"weight_version": "4"}}, "4"),
    (lambda c: c.update_weight_version("5", abort_all_requests=False), "POST",
     "/update_weight_version", {"new_version": "5", "abort_all_requests": False},
     {**OK, "result": {"weight_version": "5"}}, "5"),
    (lambda c: c.generate(input_ids=[1, 2], lora_path="a"), "POST", "/generate",
     {"input_ids": [1, 2], "return_logprob": False, "top_logprobs_num": 0,
      "logprob_start_len": -1, "lora_path": "a"}, {"text": "x"}, {"text": "x"}),
    (lambda c: c.load_lora_adapter("a", "/adapters/a", upsert=True), "POST",
     "/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a", "pinned": False,
                            "upsert": True},
     {**OK, "result": LOADED, **LOADED}, {"success": True, **LOADED}),
    (lambda c: c.unload_lora_adapter("a"), "POST", "/unload_lora_adapter", {"lora_name": "a"},
     {**OK, "result": {"loaded_adapters": {}}, "loaded_adapters": {}},
     {"success": True, "loaded_adapters": {}}),
]
ADMIN = {"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
         "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
         "/update_weights_from_tensor", "/init_weights_update_group",
         "/update_weights_from_distributed", "/destroy_weights_update_group",
         "/update_weight_version", "/get_weights_by_name", "/load_lora_adapter",
         "/unload_lora_adapter", "/load_lora_adapter_from_tensors"}


class FakeServer:
    def __init__(self, answer: Any = None, status: int = 200) -> None:
        self.answer, self.status = answer, status
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if isinstance(self.answer, str):
            return httpx.Response(self.status, text=self.answer)
        return httpx.Response(self.status, json=self.answer)

    def body(self) -> Any:
        content = self.seen[-1].content
        return json.loads(content) if content else None


def _client(server: FakeServer, **kw: Any) -> RolloutClient:
    return RolloutClient("http://rollout:30000/", transport=httpx.MockTransport(server), **kw)


@pytest.mark.parametrize("call,method,path,body,answer,expected", ROUTES,
                         ids=[r[2] for r in ROUTES])
def test_every_route_sync_and_async(call, method, path, body, answer, expected):
    server = FakeServer(answer)
    with _client(server, api_key="user", admin_api_key="admin") as client:
        assert call(client) == expected
    request = server.seen[-1]
    assert (request.method, request.url.path, server.body()) == (method, path, body)
    key = "admin" if path in ADMIN else "user"
    assert request.headers["authorization"] == f"Bearer {key}"

    async def run() -> Any:
        async with AsyncRolloutClient("http://rollout:30000",
                                      transport=httpx.MockTransport(server)) as client:
            return await call(client)
    assert asyncio.run(run()) == expected
    assert (server.seen[-1].url.path, server.body()) == (path, body)
    assert "authorization" not in server.seen[-1].headers


def test_load_lora_adapter_from_tensors_sends_handles():
    server = FakeServer({**OK, "result": LOADED, **LOADED})
    tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                torch.arange(8.0).view(2, 4))]
    with _client(server, admin_api_key="admin") as client:
        assert client.load_lora_adapter_from_tensors("a", iter(tensors), {"r": 2},
                                                     upsert=True) == {"success": True, **LOADED}
    body = server.body()
    assert server.seen[-1].url.path == "/load_lora_adapter_from_tensors"
    assert {k: v for k, v in body.items() if k != "serialized_tensors"} == {
        "lora_name": "a", "config_dict": {"r": 2}, "load_format": None, "pinned": False,
        "added_tokens_config": None, "upsert": True}
    got = deserialize_named_tensors(body["serialized_tensors"])
    assert [n for n, _ in got] == [tensors[0][0]] and torch.equal(got[0][1], tensors[0][1])


def test_update_weights_from_tensor_sends_handles():
    server = FakeServer(OK)
    tensors = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.int64))]
    with _client(server) as client:
        assert client.update_weights_from_tensor(iter(tensors), weight_version="2") == (
            True, "ok")
    body = server.body()
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache",
                         "weight_version"} and body["weight_version"] == "2"
    (payload,) = body["serialized_named_tensors"]
    got = deserialize_named_tensors(payload)
    assert [n for n, _ in got] == ["a", "b"]
    assert all(torch.equal(g, t) for (_, g), (_, t) in zip(got, tensors))


def _shm_files() -> set[str]:
    """The torch shared-memory files this process created that still have a name."""
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


class Unread:
    """A server that never reads the payload: it notes the shm files alive while the request
    is in flight, then refuses it (409) or fails it before any answer (connection reset)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.in_flight: list[set[str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.in_flight.append(_shm_files())
        if self.fail:
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(409, json={"error": {"message": "the engine is asleep"}})


@pytest.mark.parametrize("fail,error", [(False, RolloutError), (True, httpx.ReadError)],
                         ids=["refused", "failed"])
def test_a_tensor_update_lets_go_of_its_shared_memory_whatever_the_answer(fail, error):
    """The client lends the tensors' shared memory for the request only: the handles stay
    valid while it is in flight (even for tensors nobody else holds), and once it is refused
    or failed nothing of them is left in /dev/shm, sync and async."""
    before = _shm_files()
    server = Unread(fail)
    with _client(server) as client, pytest.raises(error):
        client.update_weights_from_tensor((f"w{i}", torch.full((64,), float(i)))
                                          for i in range(3))
    gc.collect()
    assert len(server.in_flight[-1] - before) == 3
    assert _shm_files() - before == set()

    async def run() -> Any:
        async with AsyncRolloutClient("http://rollout:30000",
                                      transport=httpx.MockTransport(server)) as client:
            return await client.update_weights_from_tensor(
                [("w", torch.full((64,), 7.0))])
    with pytest.raises(error):
        asyncio.run(run())
    gc.collect()
    assert len(server.in_flight[-1] - before) == 1
    assert _shm_files() - before == set()


def test_generate_batch_returns_rollouts():
    second = {**GEN_OUT, "output_ids": [7], "meta_info": {
        **GEN_OUT["meta_info"], "weight_versions": ["3", "4"],
        "output_token_logprobs": [[-0.25, 7, None]]}}
    server = FakeServer([GEN_OUT, second, GEN_OUT, GEN_OUT])
    with _client(server) as client:
        rollouts = client.generate_batch(["x", "y"], {"temperature": 1.0}, n=2)
    assert server.body() == {"text": ["x", "y"], "sampling_params": {"temperature": 1.0, "n": 2},
                             "return_logprob": True}
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(0, 0), (0, 1), (1, 0),
                                                                     (1, 1)]
    assert rollouts[0].output_ids == [5, 6] and rollouts[0].output_logprobs == [-0.5, -1.5]
    assert rollouts[1].weight_versions == ["3", "4"] and rollouts[1].weight_version == "4"
    with pytest.raises(ValueError, match="prompts_or_ids"):
        _client(server).generate_batch([])


@pytest.mark.parametrize("status,answer,message", [
    (400, {"error": {"message": "max_new_tokens: must be >= 0", "code": 400}},
     "max_new_tokens: must be >= 0"),
    (409, {"success": False, "message": "busy", "error": {"message": "busy"}}, "busy"),
    (401, {"detail": "bad key"}, "bad key"),
    (500, "Internal Server Error", "Internal Server Error"),
])
def test_errors_raise_rollout_error(status, answer, message):
    with _client(FakeServer(answer, status)) as client, pytest.raises(RolloutError) as info:
        client.flush_cache()
    assert (info.value.status, info.value.message) == (status, message)


def test_health_and_wait_healthy():
    with _client(FakeServer({"error": {"message": "asleep"}}, 503)) as client:
        assert client.health() is False
        with pytest.raises(TimeoutError, match="not healthy"):
            client.wait_healthy(timeout=0.3, interval=0.05)
    with _client(FakeServer({"status": "ok"})) as client:
        client.wait_healthy(timeout=5)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)
    client = RolloutClient("http://rollout:1", transport=httpx.MockTransport(refuse))
    with pytest.raises(TimeoutError, match="refused"):
        client.wait_healthy(timeout=0.2, interval=0.05)
