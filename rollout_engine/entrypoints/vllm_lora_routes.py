"""vLLM's runtime LoRA routes on the engine's adapters, in vLLM's shapes:

    POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": false,
                                "is_3d_lora_weight": false}
        200 text "Success: LoRA adapter '<name>' added successfully."
    POST /v1/unload_lora_adapter {"lora_name", "lora_int_id": null}
        200 text "Success: LoRA adapter '<name>' removed successfully."

Errors are vLLM's ``{"error": {"message", "type", "param", "code"}}``: a missing or empty name or
path 400 (``InvalidUserInput``), a name the base model is served under 400, a name already
loaded without ``load_inplace`` 400, an adapter directory that does not exist 404
(``NotFoundError``), an unload of a name not loaded 404; ours beside them: an adapter the engine
refuses (its rank, its target modules, LoRA not enabled) 400 naming why, an unload while
requests use the adapter 409. ``load_inplace`` is our upsert: the name's weights are replaced at
once; requests already taken finish on the old ones, and the cache never mixes the two.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import read_json
from rollout_engine.entrypoints.vllm_calls import VllmCallError, vllm_call, vllm_error

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

__all__ = ["add_vllm_lora_routes"]

LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace", "is_3d_lora_weight"}
UNLOAD_FIELDS = {"lora_name", "lora_int_id"}


def _text(message: str) -> Response:
    return Response(message, status_code=200, media_type="text/plain; charset=utf-8")


def add_vllm_lora_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (admin key)."""

    async def loaded() -> dict[str, Any]:
        adapters: dict[str, Any] = (await vllm_call(engine, "list_lora_adapters")
                                    )["loaded_adapters"]
        return adapters

    def invalid(message: str, param: str) -> Response:
        return vllm_error(400, message, "InvalidUserInput", param)

    def unknown_fields(body: dict[str, Any], known: set[str]) -> Response | None:
        extra = sorted(set(body) - known)
        if extra:
            return invalid(f"unknown field(s) {extra}; the fields are {sorted(known)}", extra[0])
        return None

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(request: Request) -> Response:
        body = await read_json(request)
        bad = unknown_fields(body, LOAD_FIELDS)
        if bad is not None:
            return bad
        name, path = body.get("lora_name"), body.get("lora_path")
        inplace = body.get("load_inplace", False)
        for field, value in (("lora_name", name), ("lora_path", path)):
            if value is not None and not isinstance(value, str):
                return invalid(f"{field}: must be a string, got {value!r}", field)
        if not name or not path:
            return invalid("Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_name" if not name else "lora_path")
        if not isinstance(inplace, bool):
            return invalid(f"load_inplace: must be true or false, got {inplace!r}",
                           "load_inplace")
        if body.get("is_3d_lora_weight", False) is not False:
            return invalid("is_3d_lora_weight: 3D (fused MoE expert) LoRA weights are not "
                           "supported; leave it false", "is_3d_lora_weight")
        cfg = engine.config
        if name in {cfg.served_model_name, cfg.model_path}:
            return invalid(f"The lora adapter '{name}' conflicts with a served base model.",
                           "lora_name")
        try:
            already = name in await loaded()
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        if not inplace and already:
            return invalid(f"The lora adapter '{name}' has already been loaded. If you want "
                           "to load the adapter in place, set 'load_inplace' to True.",
                           "lora_name")
        if not os.path.exists(path):
            return vllm_error(404, f"Loading lora {name} failed: No adapter found for {path}",
                              "NotFoundError")
        try:
            await vllm_call(engine, "load_lora_adapter", lora_name=name, lora_path=path,
                            upsert=inplace)
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(request: Request) -> Response:
        body = await read_json(request)
        bad = unknown_fields(body, UNLOAD_FIELDS)
        if bad is not None:
            return bad
        name, int_id = body.get("lora_name"), body.get("lora_int_id")
        if name is not None and not isinstance(name, str):
            return invalid(f"lora_name: must be a string, got {name!r}", "lora_name")
        if not name:
            return invalid("'lora_name' needs to be provided to unload a LoRA adapter.",
                           "lora_name")
        if int_id is not None and (not isinstance(int_id, int) or isinstance(int_id, bool)):
            return invalid(f"lora_int_id: must be an integer or null, got {int_id!r}",
                           "lora_int_id")
        try:
            known = name in await loaded()
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        if not known:
            return vllm_error(404, f"The lora adapter '{name}' cannot be found.",
                              "NotFoundError")
        try:
            await vllm_call(engine, "unload_lora_adapter", lora_name=name)
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")
