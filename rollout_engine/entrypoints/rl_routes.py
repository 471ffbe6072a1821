"""RL control-plane routes: weight version, sleep / wake, refit, pause / continue.

Each route is a thin proxy of one scheduler control call through ``http_utils.control``, which
maps ``ControlResult.status`` to the HTTP status with a ``{"success", "message"}`` body. Every
route but ``/get_weight_version`` changes state or reads weights and needs the admin key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import (
    HTTPError,
    check_fields,
    control,
    json_response,
    read_json,
)

REQUIRED = object()   # a field the body must carry

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine


def add_rl_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register the RL control routes on ``app``; ``admin`` is the admin-key dependency list."""

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        r = await engine.tm.async_call("get_server_info")
        if not r.success:
            raise HTTPError(r.status, r.message)
        return json_response({"weight_version": r.result["weight_version"]})

    def proxy(route: str, method: str, fields: dict[str, Any], http_method: str = "POST"
              ) -> None:
        """One route forwarding a JSON body's ``fields`` (name -> default) to a control call."""

        async def handler(request: Request) -> Response:
            if request.method == "GET":
                body: dict[str, Any] = {k: int(v) if v.lstrip("-").isdigit() else v
                                        for k, v in request.query_params.items()}
            else:
                body = await read_json(request, optional=True)
            check_fields(body, set(fields), route.strip("/"))
            missing = [k for k, d in fields.items() if d is REQUIRED and body.get(k) is None]
            if missing:
                raise HTTPError(400, f"{route.strip('/')}: missing required field(s) {missing}")
            kwargs = {k: body.get(k, None if d is REQUIRED else d) for k, d in fields.items()}
            return await control(engine, method, **kwargs)

        app.add_api_route(route, handler, methods=[http_method],
                          dependencies=admin, name=method)

    proxy("/release_memory_occupation", "release_memory_occupation", {"tags": None})
    proxy("/resume_memory_occupation", "resume_memory_occupation", {"tags": None})
    proxy("/update_weights_from_disk", "update_weights_from_disk", {
        "model_path": REQUIRED, "load_format": None, "weight_version": None, "flush_cache": True,
        "abort_all_requests": False})
    proxy("/update_weights_from_tensor", "update_weights_from_tensor", {
        "serialized_named_tensors": REQUIRED, "load_format": None, "flush_cache": True,
        "weight_version": None})
    proxy("/init_weights_update_group", "init_weights_update_group", {
        "master_address": REQUIRED, "master_port": REQUIRED, "rank_offset": REQUIRED,
        "world_size": REQUIRED,
        "group_name": "weight_update_group", "backend": "nccl"})
    proxy("/update_weights_from_distributed", "update_weights_from_distributed", {
        "names": REQUIRED, "dtypes": REQUIRED, "shapes": REQUIRED, "group_name": "weight_update_group",
        "load_format": None, "flush_cache": True, "weight_version": None})
    proxy("/destroy_weights_update_group", "destroy_weights_update_group",
          {"group_name": "weight_update_group"})
    proxy("/update_weight_version", "update_weight_version", {"new_version": REQUIRED})
    proxy("/pause_generation", "pause_generation", {"mode": "abort"})
    proxy("/continue_generation", "continue_generation", {})
    # admin only: it reads the weights (bounded: rl_control.MAX_TRUNCATE_ROWS rows, 400 beyond)
    for http_method in ("GET", "POST"):
        proxy("/get_weights_by_name", "get_weights_by_name",
              {"name": REQUIRED, "truncate_size": 100}, http_method=http_method)
