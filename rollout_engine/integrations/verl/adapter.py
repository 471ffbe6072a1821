"""`ServerAdapter`: the trainer side of verl's rollout for this engine, the counterpart of
verl's SGLang ``ServerAdapter`` (``get_rollout_class("rollout_engine", "async")``).

It lives in each trainer (or checkpoint-engine) worker and reaches its replica's server over
HTTP: ``resume(tags)`` / ``release()`` wake and sleep the engine, ``update_weights(weights)``
refits it. Every worker of a replica iterates the weights (a DTensor's ``full_tensor()`` is a
collective); only the replica's first rank (``is_leader_rank``) talks to the server. Weights
travel as ``/update_weights_from_tensor`` calls of at most
``checkpoint_engine.update_weights_bucket_megabytes`` each: tensor handles (CUDA IPC, or CPU
shared memory lent until the call is answered), one payload every engine rank applies; the
last call flushes the prefix cache and sets the weight version to ``global_steps``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from typing import Any, Optional, Union

import torch
from torch.distributed.tensor import DTensor
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout

from rollout_engine.integrations.verl.engine_http import EngineHttp
from rollout_engine.integrations.verl.server import engine_options
from rollout_engine.protocol.tensor_payload import lend_named_tensors

__all__ = ["ServerAdapter"]

Weights = Union[Iterable[tuple[str, torch.Tensor]], AsyncIterator[tuple[str, torch.Tensor]]]


async def _items(weights: Weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:   # type: ignore[union-attr]
            yield item
    else:
        for item in weights:         # type: ignore[union-attr]
            yield item


class ServerAdapter(BaseRollout):
    """Arguments are verl's for a rollout adapter; ``server_address`` ("host:port") reaches a
    server directly instead of looking up the replica's server actor by name."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh: Any,
                 replica_rank: int = -1, server_address: Optional[str] = None) -> None:
        super().__init__(config, model_config, device_mesh)
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.server_address = server_address
        options = engine_options(self.config)
        self._api_key = options.get("admin_api_key") or options.get("api_key")
        self._http: Optional[EngineHttp] = None

    @property
    def is_leader_rank(self) -> bool:
        """The replica's first rank: the one that calls the server."""
        return self.rollout_rank == 0

    async def _engine(self) -> Optional[EngineHttp]:
        if not self.is_leader_rank:
            return None
        if self._http is None:
            address = self.server_address or await self._look_up_server()
            self._http = EngineHttp(f"http://{address}", api_key=self._api_key)
        return self._http

    async def _look_up_server(self) -> str:
        import ray

        from rollout_engine.integrations.verl.replica import server_actor_name

        actor = ray.get_actor(server_actor_name(self.replica_rank))
        host, port = await actor.get_server_address.remote()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def resume(self, tags: list[str]) -> None:
        """Give back ``tags`` ("weights", "kv_cache") released by a sleep."""
        engine = await self._engine()
        if engine is not None and self.config.free_cache_engine:
            await engine.call("/resume_memory_occupation", {"tags": list(tags)})

    async def release(self) -> None:
        """Release the KV cache and the weights (verl's sleep)."""
        engine = await self._engine()
        if engine is not None and self.config.free_cache_engine:
            await engine.call("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})

    async def update_weights(self, weights: Weights, global_steps: Optional[int] = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Refit the engine with ``weights`` ((name, tensor) pairs, sync or async). ValueError
        for verl's delta flushes and LoRA adapter loads, which this integration does not take; an
        engine refusal raises `EngineCallError` with its message."""
        if wire_format != "named_tensors":
            raise ValueError(f"rollout_engine takes full named tensors, not wire_format="
                             f"{wire_format!r}: use a checkpoint engine other than delta_sharded")
        if kwargs.get("peft_config") and kwargs.get("base_sync_done"):
            raise ValueError("rollout_engine's verl integration loads no LoRA adapters yet "
                             "(the engine serves them, --enable-lora, but verl's adapter path "
                             "is not wired): set actor_rollout_ref.model.lora.merge=True")
        engine = await self._engine()
        bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        async for name, tensor in _items(weights):
            tensor = tensor.detach()
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()   # a collective: every rank takes part
            if engine is None:
                continue
            num_bytes = tensor.numel() * tensor.element_size()
            if bucket and size + num_bytes > bucket_bytes:
                await self._send(engine, bucket, last=False, global_steps=None)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += num_bytes
        if engine is not None:
            await self._send(engine, bucket, last=True, global_steps=global_steps)

    async def _send(self, engine: EngineHttp, bucket: list[tuple[str, torch.Tensor]], *,
                    last: bool, global_steps: Optional[int]) -> None:
        version = None if global_steps is None else str(global_steps)
        if not bucket:   # nothing (left) to send: the last call's flush and version alone
            if version is not None:
                await engine.call("/update_weight_version",
                                  {"new_version": version, "abort_all_requests": False})
            await engine.call("/flush_cache", {})
            return
        text, lease = lend_named_tensors(bucket)
        with lease:   # the tensors stay lent until the engine answered, whatever it answered
            await engine.call("/update_weights_from_tensor", {
                "serialized_named_tensors": [text], "load_format": None,
                "flush_cache": last, "weight_version": version if last else None})
