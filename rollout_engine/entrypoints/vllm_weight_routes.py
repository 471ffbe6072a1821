"""vLLM's weight routes on the same engine: ``/update_weights`` (a ``weight_dir`` body: load the
directory's safetensors; an ``update_info`` body: vLLM's native weight transfer),
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/finish_weight_update``,
``/get_world_size`` and ``/collective_rpc``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine


def add_vllm_weight_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register vLLM's weight routes; ``admin`` is the admin-key dependency list."""
