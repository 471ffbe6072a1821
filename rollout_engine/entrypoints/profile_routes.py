"""``/start_profile`` and ``/stop_profile`` (SGLang's ``ProfileReqInput``): the torch profiler in
every scheduler process (``control/profiler.py``). Both need the admin key: the server writes
trace files where the caller asks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import check_fields, control, read_json

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

PROFILE_FIELDS = {"output_dir", "start_step", "num_steps", "activities", "with_stack",
                  "record_shapes", "profile_by_stage", "merge_profiles", "profile_id",
                  "profile_prefix", "profile_stages"}


def add_profile_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    @app.api_route("/start_profile", methods=["GET", "POST"], dependencies=admin)
    async def start_profile(request: Request) -> Response:
        body = await read_json(request, optional=True) if request.method == "POST" else {}
        check_fields(body, PROFILE_FIELDS | {"rid", "http_worker_ipc"}, "start_profile")
        kwargs = {k: v for k, v in body.items() if k in PROFILE_FIELDS and v is not None}
        return await control(engine, "start_profile", **kwargs)

    @app.api_route("/stop_profile", methods=["GET", "POST"], dependencies=admin)
    async def stop_profile() -> Response:
        return await control(engine, "stop_profile")
