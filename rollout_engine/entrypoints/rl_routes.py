"""RL control-plane routes: weight version, and (to come) sleep / wake, refit, pause / continue.

Each route is a thin proxy of one scheduler control call through ``http_utils.control``, which
maps ``ControlResult.status`` to the HTTP status with a ``{"success", "message"}`` body. Routes
that change state are guarded by the admin key (``admin`` dependencies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import HTTPError, json_response

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

    # ------------------------------------------------------------------------------------------
    # RL CONTROL ROUTES GO HERE (lead): /release_memory_occupation, /resume_memory_occupation,
    # /update_weights_from_disk, /update_weights_from_tensor, /init_weights_update_group,
    # /update_weights_from_distributed, /destroy_weights_update_group, /get_weights_by_name,
    # /update_weight_version, /pause_generation, /continue_generation. Pattern:
    #
    #     @app.post("/release_memory_occupation", dependencies=admin)
    #     async def release_memory_occupation(request: Request) -> Response:
    #         body = await read_json(request, optional=True)
    #         check_fields(body, {"tags"}, "release_memory_occupation")
    #         return await control(engine, "release_memory_occupation", tags=body.get("tags"))
    # ------------------------------------------------------------------------------------------
