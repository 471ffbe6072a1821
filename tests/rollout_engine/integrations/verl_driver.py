"""Run by the verl test's virtual environment (verl 0.9.1 installed): verl's own classes drive
one of our servers, and what they saw is printed as JSON on the last line.

    python verl_driver.py MODEL_PATH PLUGIN_DIR

PLUGIN_DIR holds a distribution whose ``verl.plugins`` entry point is the one pyproject.toml
declares, so ``import verl`` alone must register the rollout (verl's plugin loading).
Replica calls go through verl's ``RolloutReplica`` methods; the server actor is called in this
process (``Local`` stands in for the Ray handle: ``.remote()`` returns the coroutine verl's
replica gathers). The trainer side is ``get_rollout_class("rollout_engine")``'s adapter.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

sys.path.insert(0, sys.argv[2])

import verl  # noqa: E402,F401 - loads the verl.plugins entry points, ours among them
from safetensors.torch import load_file  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.config.rollout import CheckpointEngineConfig  # noqa: E402
from verl.workers.rollout.base import BaseRollout, get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import (  # noqa: E402
    RolloutMode,
    RolloutReplica,
    TokenOutput,
    get_rollout_replica_class,
)

MODEL = sys.argv[1]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "logprobs": True}
PROMPT = [11, 22, 33, 44]


class Local:
    """A server object where verl's replica expects a Ray actor handle."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)

        class Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                out = method(*args, **kwargs)
                return out if asyncio.iscoroutine(out) else asyncio.sleep(0, out)

        return Remote


async def engine_has(server: Any, key: str, count: int, timeout_s: float = 30.0) -> None:
    """Wait until the engine's ``key`` (num_running_reqs, num_waiting_reqs) reaches ``count``."""
    http = server._engine()
    deadline = time.monotonic() + timeout_s
    while (await http.call("/get_server_info", method="GET"))[key] < count:
        assert time.monotonic() < deadline, f"{key} never reached {count}"
        await asyncio.sleep(0.01)


def summary(out: TokenOutput) -> dict[str, Any]:
    return {"token_ids": out.token_ids, "log_probs": out.log_probs,
            "stop_reason": out.stop_reason, "global_steps": out.extra_fields.get("global_steps")}


async def main() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    replica_cls = get_rollout_replica_class("rollout_engine")
    adapter_cls = get_rollout_class("rollout_engine", "async")
    seen["classes"] = [replica_cls.__module__ + "." + replica_cls.__name__,
                       adapter_cls.__module__ + "." + adapter_cls.__name__]
    seen["subclasses"] = [issubclass(replica_cls, RolloutReplica),
                          issubclass(adapter_cls, BaseRollout)]

    def rollout_config(bucket_megabytes: int = 2048) -> RolloutConfig:
        return RolloutConfig(
            name="rollout_engine", mode="async", tensor_model_parallel_size=1, prompt_length=64,
            response_length=16, max_model_len=512, dtype="float32", free_cache_engine=True,
            engine_kwargs={"rollout_engine": {"host": "127.0.0.1", "device": "cpu",
                                              "scheduler_mode": "thread"}},
            checkpoint_engine=CheckpointEngineConfig(
                update_weights_bucket_megabytes=bucket_megabytes))

    config = rollout_config()
    model = HFModelConfig(path=MODEL)
    replica = replica_cls(replica_rank=0, config=config, model_config=model, gpus_per_node=1)
    replica.rollout_mode = RolloutMode.COLOCATED
    from rollout_engine.integrations.verl.server import RolloutEngineServer

    server = RolloutEngineServer(config=replica.config, model_config=model,
                                 rollout_mode=RolloutMode.COLOCATED, workers=[], replica_rank=0,
                                 node_rank=0, nnodes=1, cuda_visible_devices="", base_gpu_id=0)
    await server.launch_server()
    replica.servers = [Local(server)]
    try:
        host, port = server.get_server_address()
        seen["first"] = summary(await server.generate(PROMPT, dict(GREEDY), "first"))
        seen["default_length"] = len((await server.generate(
            PROMPT, {"temperature": 0.0, "ignore_eos": True}, "default-length")).token_ids)

        # pause: a running request is aborted with what it generated; new ones are held,
        # or with reject_request answered "aborted" at once
        long = asyncio.create_task(server.generate(
            PROMPT, {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True,
                     "logprobs": True}, "long"))
        await engine_has(server, "num_running_reqs", 1)
        await replica.abort_all_requests()
        aborted = await long
        seen["aborted"] = {**summary(aborted), "num_tokens": len(aborted.token_ids)}
        held = asyncio.create_task(server.generate(PROMPT, dict(GREEDY), "held"))
        await engine_has(server, "num_waiting_reqs", 1)
        seen["held_while_paused"] = not held.done()
        await replica.resume_generation()
        seen["held"] = summary(await held)
        await replica.abort_all_requests(reject_request=True)
        seen["rejected"] = summary(await server.generate(PROMPT, dict(GREEDY), "rejected"))
        await replica.resume_generation()

        # sleep / wake through verl's replica methods
        await replica.sleep()
        try:
            await server.generate(PROMPT, dict(GREEDY), "asleep")
            seen["asleep_error"] = None
        except Exception as e:   # noqa: BLE001 - what the engine answers while asleep
            seen["asleep_error"] = str(e)
        await replica.wake_up()
        seen["woken"] = summary(await server.generate(PROMPT, dict(GREEDY), "woken"))
        await replica.release_kv_cache()
        await replica.resume_kv_cache()
        await replica.clear_kv_cache()

        # refit through verl's trainer-side adapter (hybrid order: release, resume weights,
        # update, resume kv_cache)
        adapter = adapter_cls(config=config, model_config=model, device_mesh=None,
                              server_address=f"{host}:{port}")
        per_tensor = adapter_cls(config=rollout_config(0), model_config=model, device_mesh=None,
                                 server_address=f"{host}:{port}")   # a call a tensor
        seen["leader"] = adapter.is_leader_rank
        weights = load_file(f"{MODEL}/model.safetensors")
        halved = {n: t * 0.5 if t.is_floating_point() else t for n, t in weights.items()}
        await adapter.release()
        await adapter.resume(tags=["weights"])
        await per_tensor.update_weights(iter(halved.items()), global_steps=7)
        await adapter.resume(tags=["kv_cache"])
        seen["refit"] = summary(await server.generate(PROMPT, dict(GREEDY), "refit"))

        async def originals():
            for item in weights.items():
                yield item

        await adapter.update_weights(originals(), global_steps=8)
        seen["restored"] = summary(await server.generate(PROMPT, dict(GREEDY), "restored"))
        try:
            await adapter.update_weights(iter([("model.no_such.weight", weights[
                "model.norm.weight"])]), global_steps=9)
            seen["bad_refit"] = None
        except Exception as e:   # noqa: BLE001
            seen["bad_refit"] = f"{type(e).__name__}: {e}"
        seen["after_bad"] = summary(await server.generate(PROMPT, dict(GREEDY), "after-bad"))
    finally:
        seen["exit_code"] = await server.shutdown()
    return seen


print(json.dumps(asyncio.run(main())))
