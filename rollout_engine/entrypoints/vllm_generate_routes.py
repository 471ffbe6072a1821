"""vLLM's data routes on the same engine: ``/inference/v1/generate`` (token in, token out),
``/tokenize`` and ``/detokenize``, in vLLM's request and response shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine
    from rollout_engine.entrypoints.serving import GenerationService


def add_vllm_generate_routes(app: FastAPI, engine: Engine, service: GenerationService,
                             admin: list[Any]) -> None:
    """Register vLLM's data routes; ``admin`` is the admin-key dependency list."""
