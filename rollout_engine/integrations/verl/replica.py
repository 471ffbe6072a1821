"""`RolloutEngineReplica`: verl's rollout replica for this engine, the counterpart of verl's
``SGLangReplica``. verl builds it from ``RolloutReplicaRegistry`` by ``rollout.name``
(``rollout_engine``) and calls the base class's ``init_hybrid`` / ``init_colocated`` /
``init_standalone``, which come here to `launch_servers`; its sleep, wake-up and KV calls
(the base class's, abort and resume included) go to its one server.

A replica is one node: ``tensor_model_parallel_size x data_parallel_size`` GPUs of it (the
engine's ``--tp-size`` / ``--dp-size``), served by one `RolloutEngineServer` actor placed on the
node of the replica's first worker, with the workers' GPUs visible to it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.plugin.platform import get_platform
from verl.utils.device import get_visible_devices_keyword
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutReplica

from rollout_engine.integrations.verl.server import RolloutEngineServer, engine_options

__all__ = ["RolloutEngineReplica", "server_actor_name"]


def server_actor_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """The server actor's Ray name (``role``: "", "reward_" or "teacher_"); the trainer-side
    adapter looks up ``server_actor_name(replica_rank)``."""
    return f"rollout_engine_server_{role}{replica_rank}_0{suffix}"


class RolloutEngineReplica(RolloutReplica):
    """verl's replica contract for this engine; arguments are the base class's."""

    def __init__(self, replica_rank: int, config: RolloutConfig, model_config: HFModelConfig,
                 gpus_per_node: int = 8, is_reward_model: bool = False,
                 is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model,
                         is_teacher_model, name_suffix)
        if self.config.pipeline_model_parallel_size != 1:
            raise ValueError("rollout_engine has no pipeline parallelism: set "
                             "rollout.pipeline_model_parallel_size=1")
        if self.nnodes != 1:
            raise ValueError(f"rollout_engine serves a replica from one node: tensor x data "
                             f"parallel size ({self.world_size}) must be at most "
                             f"gpus_per_node ({gpus_per_node})")
        if self.config.get("disaggregation", None) is not None and \
                self.config.disaggregation.enabled:
            raise ValueError("rollout_engine's verl replica does not start prefill/decode pairs "
                             "(run --disaggregation-mode servers behind sglang-router's PD "
                             "mode instead): set rollout.disaggregation.enabled=False")
        self.server_class = ray.remote(RolloutEngineServer)

    def rollout_worker_use_gpu(self) -> bool:
        """Workers reserve GPUs unless the engine is told to run on the CPU."""
        return str(engine_options(self.config).get("device", "")) != "cpu"

    def _actor_name(self) -> str:
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        return server_actor_name(self.replica_rank, role, self.name_suffix)

    async def launch_servers(self) -> None:
        """Start the server actor beside the replica's workers, launch the engine, and publish
        its address (``server_address``) and handle (``server_handle``)."""
        if len(self.workers) != self.world_size:
            raise RuntimeError(f"replica {self.replica_rank} has {len(self.workers)} workers, "
                               f"expected {self.world_size}")
        keyword = get_visible_devices_keyword()

        def where(worker: Any) -> tuple[str, str]:
            return ray.get_runtime_context().get_node_id(), os.environ.get(keyword, "")

        infos = await asyncio.gather(*[w.__ray_call__.remote(where) for w in self.workers])
        node_id = infos[0][0]
        devices = sorted({int(d) for _, ds in infos for d in ds.split(",") if d.strip()})
        base_gpu_id = 0
        if os.environ.get(f"RAY_EXPERIMENTAL_NOSET_{keyword}"):
            base_gpu_id = (self.replica_rank * self.world_size) % self.gpus_per_node
        platform = get_platform()
        server = self.server_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": {**{v: "1" for v in platform.ray_noset_envvars()},
                                      **platform.rollout_env_vars()}},
            name=self._actor_name(),
            max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config,
                 rollout_mode=self.rollout_mode, workers=self.workers,
                 replica_rank=self.replica_rank, node_rank=0, nnodes=1,
                 cuda_visible_devices=",".join(map(str, devices)), base_gpu_id=base_gpu_id)
        self.servers.append(server)
        await server.launch_server.remote()
        host, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
