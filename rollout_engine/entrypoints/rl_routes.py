"""RL control-plane routes: weight version, sleep / wake, refit, pause / continue, the
weight-update session (``/begin_weight_update``, ``/end_weight_update``) and ``/weights_checker``.

Each route (``CONTROL_ROUTES``) is a thin proxy of one scheduler control call through
``http_utils.control``, which coerces the body's values to the call's declared types as SGLang's
pydantic request models do (``"master_port": "29500"`` is 29500; ``"abc"`` for an int is a 400
naming the field) and maps ``ControlResult.status`` to the HTTP status with a
``{"success", "message"}`` body. Every route but ``/get_weight_version`` changes state or reads
weights and needs the admin key.

The weight routes take every field of SGLang's request dataclasses (``io_struct.py``:
``UpdateWeightFromDiskReqInput``, ``UpdateWeightsFromTensorReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``InitWeightsUpdateGroupReqInput``, ...) with SGLang's
defaults, plus their ``BaseReq`` fields (``rid``, ignored; ``http_worker_ipc``, internal: null) and
``pp_rank`` (0 or null: one pipeline stage). The scheduler refuses a value it cannot honour,
naming the field; a name SGLang does not define either is still a 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
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
BASE_REQ = ("rid", "http_worker_ipc")   # SGLang's BaseReq fields, on every request dataclass

# SGLang's *ReqInput fields (name -> default) of each weight route
DISK_FIELDS = {
    "model_path": REQUIRED, "load_format": None, "abort_all_requests": False,
    "weight_version": None, "is_async": False, "torch_empty_cache": False, "keep_pause": False,
    "recapture_cuda_graph": False, "token_step": 0, "flush_cache": True, "manifest": None,
    "pp_rank": None, "selector": None, "draft_model_path": None}
TENSOR_FIELDS = {
    "serialized_named_tensors": REQUIRED, "load_format": None, "flush_cache": True,
    "abort_all_requests": False, "weight_version": None, "disable_draft_model": None,
    "torch_empty_cache": False, "pp_rank": None, "selector": None}
DISTRIBUTED_FIELDS = {
    "names": REQUIRED, "dtypes": REQUIRED, "shapes": REQUIRED,
    "group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
    "weight_version": None, "load_format": None, "torch_empty_cache": False, "pp_rank": None,
    "selector": None}
INIT_GROUP_FIELDS = {
    "master_address": REQUIRED, "master_port": REQUIRED, "rank_offset": REQUIRED,
    "world_size": REQUIRED, "group_name": "weight_update_group", "backend": "nccl"}
DESTROY_GROUP_FIELDS = {"group_name": "weight_update_group"}
WEIGHT_VERSION_FIELDS = {"new_version": REQUIRED, "abort_all_requests": True}
# SGLang's weight-update session (miles brackets every update with it) and weight checker
BEGIN_UPDATE_FIELDS = {"selector": "all"}
# slime's call around a quantized refit (no work here: see RLControl.rpc_post_process_weights)
POST_PROCESS_FIELDS = {"restore_weights_before_load": False, "post_process_quantization": False,
                       "post_load_weights": False}
CHECK_WEIGHTS_FIELDS = {"action": "checksum", "allow_quant_error": False, "selector": "all",
                        "skip_tensor_list": None}


@dataclass(frozen=True)
class ControlRoute:
    """A route that forwards a JSON body's ``fields`` (name -> SGLang's default) to the control
    call ``method``; ``base_req``: the body may also carry SGLang's BaseReq fields; ``lift``:
    keys of the call's result also put at the top of the answer (where SGLang has them)."""

    path: str
    method: str
    fields: Mapping[str, Any]
    http_methods: tuple[str, ...] = ("POST",)
    base_req: bool = False
    lift: tuple[str, ...] = ()


CONTROL_ROUTES = (
    ControlRoute("/release_memory_occupation", "release_memory_occupation", {"tags": None}),
    ControlRoute("/resume_memory_occupation", "resume_memory_occupation", {"tags": None}),
    ControlRoute("/update_weights_from_disk", "update_weights_from_disk", DISK_FIELDS,
                 base_req=True),
    ControlRoute("/update_weights_from_tensor", "update_weights_from_tensor", TENSOR_FIELDS,
                 base_req=True),
    ControlRoute("/init_weights_update_group", "init_weights_update_group", INIT_GROUP_FIELDS,
                 base_req=True),
    ControlRoute("/update_weights_from_distributed", "update_weights_from_distributed",
                 DISTRIBUTED_FIELDS, base_req=True),
    ControlRoute("/destroy_weights_update_group", "destroy_weights_update_group",
                 DESTROY_GROUP_FIELDS, base_req=True),
    ControlRoute("/update_weight_version", "update_weight_version", WEIGHT_VERSION_FIELDS,
                 base_req=True),
    ControlRoute("/pause_generation", "pause_generation", {"mode": "abort"}),
    ControlRoute("/continue_generation", "continue_generation", {}),
    ControlRoute("/begin_weight_update", "begin_weight_update", BEGIN_UPDATE_FIELDS,
                 base_req=True),
    ControlRoute("/end_weight_update", "end_weight_update", {}, base_req=True),
    ControlRoute("/post_process_weights", "post_process_weights", POST_PROCESS_FIELDS,
                 base_req=True),
    ControlRoute("/weights_checker", "weights_checker", CHECK_WEIGHTS_FIELDS, base_req=True,
                 lift=("ranks",)),
    # admin only: it reads the weights (bounded: rl_control.MAX_TRUNCATE_ROWS rows, 400 beyond)
    ControlRoute("/get_weights_by_name", "get_weights_by_name",
                 {"name": REQUIRED, "truncate_size": 100}, http_methods=("GET", "POST")),
)
"""Every RL control route, in the order they are registered."""

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

    add_control_routes(app, engine, CONTROL_ROUTES, admin)


def add_control_routes(app: FastAPI, engine: Engine, routes: tuple[ControlRoute, ...],
                       admin: list[Any]) -> None:
    """Register each ``ControlRoute`` of ``routes`` behind the admin-key dependency."""
    for route in routes:
        app.add_api_route(route.path, _proxy(engine, route), methods=list(route.http_methods),
                          dependencies=admin, name=route.method)


def _proxy(engine: Engine, route: ControlRoute) -> Callable[[Request], Awaitable[Response]]:
    """The handler of one ``ControlRoute``: a body's values are coerced to the call's declared
    types by ``http_utils.control`` (a GET's query strings alike)."""
    where = route.path.strip("/")
    fields = route.fields

    async def handler(request: Request) -> Response:
        if request.method == "GET":
            body: dict[str, Any] = dict(request.query_params.items())
        else:
            body = await read_json(request, optional=True)
        check_fields(body, set(fields) | set(BASE_REQ if route.base_req else ()), where)
        if route.base_req:
            _check_base_req(body, where)
        missing = [k for k, d in fields.items() if d is REQUIRED and body.get(k) is None]
        if missing:
            raise HTTPError(400, f"{where}: missing required field(s) {missing}")
        # null means the default, as in SGLang's dataclasses
        kwargs = {k: d if body.get(k) is None and d is not REQUIRED else body.get(k)
                  for k, d in fields.items()}
        return await control(engine, route.method, lift=route.lift, **kwargs)

    return handler


def _check_base_req(body: dict[str, Any], where: str) -> None:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise HTTPError(400, f"{where}: rid must be a string or null, got {rid!r}")
    if body.get("http_worker_ipc") is not None:
        raise HTTPError(400, f"{where}: http_worker_ipc is SGLang's internal routing field; "
                             "leave it null")
