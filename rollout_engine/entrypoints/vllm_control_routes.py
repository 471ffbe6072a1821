"""vLLM's RL control routes on the same engine: ``/pause``, ``/resume``, ``/is_paused``,
``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache`` and the LoRA routes
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, in vLLM's shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine


def add_vllm_control_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register vLLM's control routes; ``admin`` is the admin-key dependency list."""
