"""vLLM's weight routes on the same engine, in vLLM's shapes.

    POST /update_weights   {"weight_dir": DIR}     prime-rl's filesystem refit: the directory's
                                                   safetensors (update_weights_from_disk);
                                                   answers {"status": "ok"}
                           {"update_info": {...}}  one call of vLLM's native transfer (the
                                                   nccl backend's metadata, or the ipc
                                                   backend's CUDA IPC handles: whichever
                                                   init_info selected); answers
                                                   {"message": "Weights updated"}
    POST /init_weight_transfer_engine {"init_info"}, /start_weight_update,
         /finish_weight_update {"weight_version"?}, /shutdown_weight_transfer_engine
                                                   the native transfer (control/vllm_transfer.py)
    GET  /get_world_size?include_dp=               {"world_size"}: tp_size (x dp_size)
    POST /collective_rpc {method, args, kwargs, timeout}
                                                   the worker-extension methods SkyRL calls,
                                                   by name from a fixed table (any other: 400)

Errors are ``{"error": {"message", "code"}}``: 400 bad input, 409 busy, 503 dead, 504 late.
Every route needs the admin key (SkyRL's client sends its key on each call).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import (
    HTTPError,
    check_fields,
    error_response,
    json_response,
    read_json,
)
from rollout_engine.tokenizer_manager import SchedulerDeadError

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

TRANSFER_TIMEOUT_S = 600.0   # a native transfer call waits this long at most for its answer


def _flag(value: Optional[str], name: str, default: bool) -> bool:
    if value is None:
        return default
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise HTTPError(400, f"{name}: must be true or false, got {value!r}")


def add_vllm_weight_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register vLLM's weight routes; ``admin`` is the admin-key dependency list."""
    cfg = engine.config

    async def call(method: str, answer: dict[str, Any], **kwargs: Any) -> Response:
        """Run control call ``method``; ``answer`` on success, the error body otherwise."""
        if method.startswith("vllm_") and (cfg.tp_size > 1 or cfg.dp_size > 1):
            raise HTTPError(400, "vLLM's native weight transfer runs on one scheduler: "
                                 "not with --tp-size or --dp-size above 1 (use "
                                 "/init_weights_update_group)")
        try:
            timeout = TRANSFER_TIMEOUT_S if method.startswith("vllm_") else None
            r = await engine.tm.async_call(method, timeout, **kwargs)
        except SchedulerDeadError as e:
            return error_response(503, str(e))
        if not r.success:
            return error_response(r.status, r.message or f"{method} failed")
        return json_response(answer)

    async def update_from_dir(weight_dir: Any) -> Response:
        if not isinstance(weight_dir, str) or not weight_dir:
            raise HTTPError(400, "weight_dir: must be the path of a directory of safetensors "
                                 f"files, got {weight_dir!r}")
        if not await asyncio.to_thread(os.path.isdir, weight_dir):
            raise HTTPError(400, f"weight_dir: {weight_dir!r} is not a directory on the "
                                 "server")
        return await call("update_weights_from_disk", {"status": "ok"}, model_path=weight_dir)

    @app.post("/update_weights", dependencies=admin)
    async def update_weights(request: Request) -> Response:
        body = await read_json(request)
        has_dir, has_info = "weight_dir" in body, "update_info" in body
        if has_dir == has_info:
            raise HTTPError(400, "update_weights: give exactly one of weight_dir (a checkpoint "
                                 "directory to load) or update_info (vLLM's weight transfer), "
                                 f"got {'both' if has_dir else 'neither'}")
        if has_dir:
            check_fields(body, {"weight_dir"}, "update_weights")
            return await update_from_dir(body["weight_dir"])
        check_fields(body, {"update_info"}, "update_weights")
        return await call("vllm_update_weights", {"message": "Weights updated"},
                          update_info=body["update_info"])

    @app.post("/init_weight_transfer_engine", dependencies=admin)
    async def init_weight_transfer_engine(request: Request) -> Response:
        body = await read_json(request)
        check_fields(body, {"init_info"}, "init_weight_transfer_engine")
        if "init_info" not in body:
            raise HTTPError(400, "init_weight_transfer_engine: missing field init_info")
        return await call("vllm_init_weight_transfer",
                          {"message": "Weight transfer initialized"},
                          init_info=body["init_info"])

    @app.post("/start_weight_update", dependencies=admin)
    async def start_weight_update(request: Request) -> Response:
        check_fields(await read_json(request, optional=True), set(), "start_weight_update")
        return await call("vllm_start_weight_update", {"message": "Weight update started"})

    @app.post("/finish_weight_update", dependencies=admin)
    async def finish_weight_update(request: Request) -> Response:
        body = await read_json(request, optional=True)
        check_fields(body, {"weight_version"}, "finish_weight_update")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise HTTPError(400, f"weight_version: must be a string or null, got {version!r}")
        return await call("vllm_finish_weight_update", {"message": "Weight update finished"},
                          weight_version=version)

    @app.post("/shutdown_weight_transfer_engine", dependencies=admin)
    async def shutdown_weight_transfer_engine() -> Response:
        return await call("vllm_shutdown_weight_transfer",
                          {"message": "Weight transfer shut down"})

    @app.get("/get_world_size", dependencies=admin)
    async def get_world_size(include_dp: Optional[str] = None) -> Response:
        """vLLM's parallel world: TP x PP (one stage here), x DP unless include_dp=false."""
        with_dp = _flag(include_dp, "include_dp", True)
        return json_response({"world_size": cfg.tp_size * (cfg.dp_size if with_dp else 1)})

    rpc_table = _rpc_table(call)

    @app.post("/collective_rpc", dependencies=admin)
    async def collective_rpc(request: Request) -> Response:
        body = await read_json(request)
        check_fields(body, {"method", "args", "kwargs", "timeout"}, "collective_rpc")
        method = body.get("method")
        if not isinstance(method, str):
            raise HTTPError(400, "collective_rpc: missing 'method' in request body")
        run = rpc_table.get(method)
        if run is None:
            raise HTTPError(400, f"collective_rpc: method {method!r} is not one this engine "
                                 f"runs; it runs {sorted(rpc_table)}")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise HTTPError(400, "collective_rpc: args must be a list and kwargs an object")
        return await run(args, kwargs)


RpcHandler = Callable[[list[Any], dict[str, Any]], Any]


def _bind(name: str, args: list[Any], kwargs: dict[str, Any], params: tuple[str, ...],
          required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``args`` / ``kwargs`` of a worker method with parameters ``params`` (ValueError-free:
    HTTP 400 naming what is wrong)."""
    if len(args) > len(params):
        raise HTTPError(400, f"collective_rpc {name}: takes at most {len(params)} positional "
                             f"argument(s) {list(params)}, got {len(args)}")
    bound = dict(zip(params, args))
    for key, value in kwargs.items():
        if key not in params:
            raise HTTPError(400, f"collective_rpc {name}: unknown argument {key!r}; it takes "
                                 f"{list(params)}")
        if key in bound:
            raise HTTPError(400, f"collective_rpc {name}: {key!r} given twice")
        bound[key] = value
    missing = [k for k in required if k not in bound]
    if missing:
        raise HTTPError(400, f"collective_rpc {name}: missing argument(s) {missing}")
    return bound


def _rpc_table(call: Callable[..., Any]) -> dict[str, RpcHandler]:
    """SkyRL's worker-extension methods (and vLLM's own worker methods of the same protocol),
    each mapped onto a control call; vLLM answers ``{"results": [one per worker]}``."""
    done = {"results": [None]}

    async def start(args: list[Any], kwargs: dict[str, Any]) -> Response:
        bound = _bind("start_weight_update", args, kwargs, ("is_checkpoint_format",))
        if not isinstance(bound.get("is_checkpoint_format", True), bool):
            raise HTTPError(400, "is_checkpoint_format: must be true or false")
        return await call("vllm_start_weight_update", done)

    def update_as(name: str) -> RpcHandler:
        """``name``'s ``update_info`` to the open update: the backend init selected reads it
        (a broadcast's metadata, or the ipc backend's CUDA IPC handles)."""
        async def update(args: list[Any], kwargs: dict[str, Any]) -> Response:
            bound = _bind(name, args, kwargs, ("update_info",), ("update_info",))
            return await call("vllm_update_weights", done, update_info=bound["update_info"])
        return update

    async def finish(args: list[Any], kwargs: dict[str, Any]) -> Response:
        _bind("finish_weight_update", args, kwargs, ())
        return await call("vllm_finish_weight_update", done)

    async def init(args: list[Any], kwargs: dict[str, Any]) -> Response:
        bound = _bind("init_weight_transfer_engine", args, kwargs, ("init_info",),
                      ("init_info",))
        return await call("vllm_init_weight_transfer", done, init_info=bound["init_info"])

    async def shutdown(args: list[Any], kwargs: dict[str, Any]) -> Response:
        _bind("shutdown_weight_transfer_engine", args, kwargs, ())
        return await call("vllm_shutdown_weight_transfer", done)

    async def sleep(args: list[Any], kwargs: dict[str, Any]) -> Response:
        bound = _bind("skyrl_sleep_for_weight_sync", args, kwargs, ("offload_kv",))
        if not isinstance(bound.get("offload_kv", True), bool):
            raise HTTPError(400, "offload_kv: must be true or false")
        # the KV pool stays where it is (offloaded or not, frozen requests keep it)
        return await call("release_memory_occupation", done, tags=["weights"])

    async def wake(args: list[Any], kwargs: dict[str, Any]) -> Response:
        bound = _bind("skyrl_wake_for_weight_sync", args, kwargs, ("tags",), ("tags",))
        tags = [t for t in bound["tags"] or () if t == "weights"] \
            if isinstance(bound["tags"], list) else bound["tags"]
        if not tags:
            return json_response(done)   # the KV pool was never released
        return await call("resume_memory_occupation", done, tags=tags)

    return {
        "skyrl_start_weight_update": start, "skyrl_finish_weight_update": finish,
        "update_weights_nccl": update_as("update_weights_nccl"),
        "update_weights_ipc": update_as("update_weights_ipc"),
        "skyrl_sleep_for_weight_sync": sleep, "skyrl_wake_for_weight_sync": wake,
        "init_weight_transfer_engine": init, "start_weight_update": start,
        "update_weights": update_as("update_weights"), "finish_weight_update": finish,
        "shutdown_weight_transfer_engine": shutdown,
    }
