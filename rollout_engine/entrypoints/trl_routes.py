"""TRL's server mode (``GRPOTrainer(use_vllm=True, vllm_mode="server")``) on the same engine.

TRL 1.16 serves nothing of its own: ``trl vllm-serve`` only runs ``vllm serve`` (dev mode,
``--weight-transfer-config '{"backend": "nccl"}'``, ``--logprobs-mode processed_logprobs``,
``--max-logprobs -1``), and its ``VLLMClient`` speaks vLLM's routes, which this server answers
where they live:

    GET  /health, /v1/models                      http_server.py, openai_api.py
    GET  /server_info?config_format=json          http_server.py + vllm_server_info.py
                                                  (vllm_config.weight_transfer_config)
    GET  /get_world_size                          vllm_weight_routes.py
    POST /v1/completions, /v1/chat/completions    openai_api.py: return_token_ids,
         (generate, chat, get_sequence_logprobs)  return_tokens_as_token_ids, prompt_logprobs,
                                                  structured_outputs (vllm_structured_outputs.py)
    POST /inference/v1/generate                   vllm_generate_routes.py (TRL sends it image
                                                  features only; this engine is text-only)
    POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
         /finish_weight_update                    vllm_weight_routes.py (packed broadcasts)
    POST /reset_prefix_cache                      vllm_control_routes.py

The routes of TRL's own server before 1.16 (``/generate/``, ``/init_communicator/``,
``/update_named_param/`` ...) are not served: their weight path is a ``PyNcclCommunicator``
on both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine
    from rollout_engine.entrypoints.serving import GenerationService


def add_trl_routes(app: FastAPI, engine: Engine, service: GenerationService,
                   admin: list[Any]) -> None:
    """Register TRL's server routes; ``admin`` is the admin-key dependency list. TRL 1.16 has
    none of its own (see the module docstring), so nothing is added."""
