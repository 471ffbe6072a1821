"""Run by the verl test's virtual environment: verl's replica on a local Ray (127.0.0.1) in
colocated mode, with verl's own worker class (``CheckpointEngineWorker``, whose adapter comes
from ``get_rollout_class``), our server as a Ray actor, and generation, pause, sleep / wake and
a refit through the actors. Prints what it saw as JSON on the last line.

    python verl_ray_driver.py MODEL_PATH PLUGIN_DIR REPO_ROOT
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MODEL, PLUGINS, ROOT = sys.argv[1:4]
sys.path.insert(0, PLUGINS)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, PLUGINS])   # Ray's workers import us too
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # Ray on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from verl.single_controller.ray import RayResourcePool  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "logprobs": True}
PROMPT = [11, 22, 33, 44]


async def refit(worker: Any, weights: dict[str, Any], steps: int) -> None:
    """The worker's own adapter (verl built it from get_rollout_class) refits the server."""

    def run(self: Any, named: list, steps: int) -> None:
        # on the actor's thread, whose event loop is busy running this call: a loop of its own
        update = self.server_adapter.update_weights(iter(named), global_steps=steps)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, update).result()

    await worker.__ray_call__.remote(run, list(weights.items()), steps)


async def main() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    config = RolloutConfig(
        name="rollout_engine", mode="async", tensor_model_parallel_size=1, prompt_length=64,
        response_length=16, max_model_len=512, dtype="float32", free_cache_engine=True,
        engine_kwargs={"rollout_engine": {"device": "cpu", "scheduler_mode": "thread"}})
    model = HFModelConfig(path=MODEL)
    replica = get_rollout_replica_class("rollout_engine")(
        replica_rank=0, config=config, model_config=model, gpus_per_node=1)
    await replica.init_colocated(RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1))
    seen["address"] = replica.server_address
    server = replica.server_handle

    async def generate(rid: str, params: dict[str, Any]) -> dict[str, Any]:
        out = await server.generate.remote(prompt_ids=PROMPT, sampling_params=dict(params),
                                           request_id=rid)
        return {"token_ids": out.token_ids, "stop_reason": out.stop_reason,
                "global_steps": out.extra_fields.get("global_steps")}

    seen["first"] = await generate("first", GREEDY)
    await replica.sleep()
    await replica.wake_up()
    seen["woken"] = await generate("woken", GREEDY)
    await replica.abort_all_requests(reject_request=True)
    seen["rejected"] = await generate("rejected", GREEDY)
    await replica.resume_generation()
    weights = load_file(f"{MODEL}/model.safetensors")
    await refit(replica.workers[0], {n: t * 0.5 for n, t in weights.items()}, 5)
    seen["refit"] = await generate("refit", GREEDY)
    await refit(replica.workers[0], weights, 6)
    seen["restored"] = await generate("restored", GREEDY)
    seen["exit_code"] = await server.shutdown.remote()
    return seen


temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
ray.init(num_cpus=2, num_gpus=0, object_store_memory=100 << 20, include_dashboard=False,
         _node_ip_address="127.0.0.1", _temp_dir=temp_dir, configure_logging=False,
         log_to_driver=False)
try:
    print(json.dumps(asyncio.run(main())))
finally:
    ray.shutdown()
