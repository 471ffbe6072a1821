"""The routes of TRL's ``trl vllm-serve`` server on the same engine, so TRL's ``VLLMClient``
(``GRPOTrainer(use_vllm=True, vllm_mode="server")``) drives it unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine
    from rollout_engine.entrypoints.serving import GenerationService


def add_trl_routes(app: FastAPI, engine: Engine, service: GenerationService,
                   admin: list[Any]) -> None:
    """Register TRL's server routes; ``admin`` is the admin-key dependency list."""
