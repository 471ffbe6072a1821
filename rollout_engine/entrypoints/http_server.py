"""The rollout server: SGLang's HTTP routes over an ``Engine``.

    create_app(engine)  -> FastAPI app (native routes here, OpenAI routes in openai_api.py,
                           RL control routes in rl_routes.py)
    run_server(flags)   -> builds the Engine, serves with uvicorn, and exits non-zero when the
                           scheduler process dies (after answering /health 503 for a moment)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from contextlib import aclosing
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from starlette.responses import Response

from rollout_engine.compat.fields import GENERATE_REQUEST
from rollout_engine.entrypoints.engine import Engine
from rollout_engine.entrypoints.http_utils import (
    SSE_DONE,
    APIKeys,
    BodyLimitMiddleware,
    HTTPError,
    check_fields,
    control,
    error_response,
    exposure_warning,
    install_error_handlers,
    json_response,
    read_json,
    sse,
    sse_response,
)
from rollout_engine.entrypoints.load_routes import add_load_routes
from rollout_engine.entrypoints.lora_routes import add_lora_routes
from rollout_engine.entrypoints.metrics import Metrics
from rollout_engine.entrypoints.openai_api import add_openai_routes
from rollout_engine.entrypoints.profile_routes import add_profile_routes
from rollout_engine.entrypoints.rl_routes import add_rl_routes
from rollout_engine.entrypoints.serving import GenerationService
from rollout_engine.entrypoints.trl_routes import add_trl_routes
from rollout_engine.entrypoints.vllm_control_routes import add_vllm_control_routes
from rollout_engine.entrypoints.vllm_generate_routes import add_vllm_generate_routes
from rollout_engine.entrypoints.vllm_server_info import CONFIG_FORMATS, vllm_config
from rollout_engine.entrypoints.vllm_weight_routes import add_vllm_weight_routes
from rollout_engine.request_builder import bootstrap_fields
from rollout_engine.request_state import add_token_text
from rollout_engine.tokenizer_manager import SchedulerDeadError

logger = logging.getLogger(__name__)

# tensor payloads: --max-refit-body-bytes
REFIT_ROUTES = ("/update_weights_from_tensor", "/load_lora_adapter_from_tensors")
HEALTH_GENERATE_TIMEOUT_S = 30.0


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPError(400, f"{name}: must be a boolean, got {value!r}")
    return value


# SGLang's AbortReq (``abort_message``; some versions name it ``aborted_message``) and the
# rid-prefix abort RL routers send to stop one adapter's or one task's requests
ABORT_FIELDS = {"rid", "abort_all", "prefix", "abort_message", "aborted_message",
                "finished_reason"}
MAX_ABORT_MESSAGE = 1024


def _abort_ending(body: dict[str, Any]) -> dict[str, Any]:
    """What the aborted requests end with: their message, or a whole finished_reason."""
    out: dict[str, Any] = {}
    for name in ("abort_message", "aborted_message"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > MAX_ABORT_MESSAGE:
            raise HTTPError(400, f"{name}: must be a string of at most {MAX_ABORT_MESSAGE} "
                                 f"characters, got {str(value)[:40]!r}")
        out["message"] = value
    reason = body.get("finished_reason")
    if reason is not None:
        if not (isinstance(reason, dict) and isinstance(reason.get("type"), str)
                and len(repr(reason)) <= MAX_ABORT_MESSAGE):
            raise HTTPError(400, "finished_reason: must be an object with a string 'type' "
                                 f"(at most {MAX_ABORT_MESSAGE} characters in all)")
        out["finished_reason"] = reason
    return out


def create_app(engine: Engine, *, api_key: Optional[str] = None,
               admin_api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI app over ``engine``. Keys default to the engine's ``api_key`` and
    ``admin_api_key`` flags."""
    keys = APIKeys(api_key if api_key is not None else engine.config.api_key,
                   admin_api_key if admin_api_key is not None else engine.config.admin_api_key)
    metrics = Metrics()
    service = GenerationService(engine, metrics)

    # async, so a key check runs on the event loop: a sync dependency would wait for a worker
    # thread of a pool every request shares, and /health must not wait on request handling
    async def require_user(request: Request) -> None:
        keys.require_user(request)

    async def require_admin(request: Request) -> None:
        keys.require_admin(request)

    app = FastAPI(title="rollout_engine", dependencies=[Depends(require_user)])
    app.state.engine, app.state.service, app.state.metrics = engine, service, metrics
    cfg = engine.config
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_request_body_bytes,
                       route_limits={r: cfg.max_refit_body_bytes for r in REFIT_ROUTES})
    install_error_handlers(app, engine)
    admin = [Depends(require_admin)]
    tm = engine.tm

    # -- generation ----------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        """SGLang's ``GenerateReqInput``: every field it defines is accepted (compat/fields.py
        says how each is treated). Streams are cumulative unless incremental_streaming_output."""
        body = await read_json(request)
        GENERATE_REQUEST.check(body, "generate")
        stream, with_text = _flag(body, "stream"), _flag(body, "return_text_in_logprobs")
        states, single = await service.submit(
            prompt=body.get("text"), input_ids=body.get("input_ids"),
            sampling_params=body.get("sampling_params"),
            return_logprob=body.get("return_logprob", False),
            top_logprobs_num=body.get("top_logprobs_num", 0),
            logprob_start_len=body.get("logprob_start_len", -1), stream=stream,
            rid=body.get("rid"), extra_key=body.get("extra_key"),
            cache_salt=body.get("cache_salt"), token_ids_logprob=body.get("token_ids_logprob"),
            token_ids_logprob_positions=body.get("token_ids_logprob_positions"),
            return_routed_experts=body.get("return_routed_experts", False),
            routed_experts_start_len=body.get("routed_experts_start_len", 0),
            lora_path=body.get("lora_path"), bootstrap=bootstrap_fields(body))
        if not stream:
            results = await service.collect(states, request)
            if with_text:
                results = [add_token_text(r, tm.token_text) for r in results]
            return json_response(results[0] if single else results)
        cumulative = not cfg.incremental_streaming_output

        async def chunks() -> Any:
            try:
                async with aclosing(service.stream(states, cumulative, with_text)) as stream:
                    async for i, chunk in stream:
                        yield sse(chunk if single else {**chunk, "index": i})
            except SchedulerDeadError as e:
                yield sse({"error": {"message": str(e), "code": 503}})
            yield SSE_DONE

        return sse_response(chunks())

    add_openai_routes(app, service, engine.config.served_model_name or engine.config.model_path)

    # -- health and introspection --------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """Reads one flag: no lock, no worker thread, no scheduler round trip."""
        if tm.dead is not None:
            return error_response(503, f"the scheduler died: {tm.dead.splitlines()[0]}")
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Runs a one-token generation through the whole stack."""
        states, _ = await service.submit(input_ids=[0], sampling_params={
            "max_new_tokens": 1, "temperature": 0.0})
        try:
            await asyncio.wait_for(service.collect(states), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return error_response(503, f"a 1-token generation did not finish within "
                                       f"{HEALTH_GENERATE_TIMEOUT_S:.0f} s")
        return json_response({"status": "ok"})

    async def model_info() -> Response:
        return json_response(await asyncio.to_thread(engine.get_model_info))

    async def server_info(config_format: str = "text") -> Response:
        # One handler for SGLang's flat dict and vLLM's {"vllm_config": ...} (extra key).
        if config_format not in CONFIG_FORMATS:
            return error_response(400, f"config_format must be one of {list(CONFIG_FORMATS)}, "
                                       f"got {config_format!r}")
        info = await asyncio.to_thread(engine.get_server_info)
        return json_response({**info, "scheduler_pid": tm.host.pid,
                              "vllm_config": vllm_config(info, config_format)})

    for path in ("/get_model_info", "/model_info"):
        app.get(path)(model_info)
    for path in ("/get_server_info", "/server_info"):
        app.get(path)(server_info)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        info = None
        if tm.dead is None:
            r = await tm.async_call("get_server_info")
            info = r.result if r.success else None
        text = metrics.render(info, alive=tm.dead is None)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- control -------------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
    async def flush_cache() -> Response:
        return await control(engine, "flush_cache")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request, optional=True)
        check_fields(body, ABORT_FIELDS, "abort_request")
        ending = _abort_ending(body)
        if _flag(body, "abort_all"):
            keys.require_admin(request)
            tm.check_alive()
            tm.abort(abort_all=True, **ending)
            return json_response({"success": True, "message": "aborted every request"})
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise HTTPError(400, "rid: give the request id to abort (or abort_all: true)")
        prefix = _flag(body, "prefix")
        tm.check_alive()
        tm.abort(rid=rid, prefix=prefix, **ending)
        what = f"every request whose rid starts with {rid!r}" if prefix else repr(rid)
        return json_response({"success": True, "message": f"abort sent for {what}"})

    @app.get("/check_integrity", dependencies=admin)
    async def check_integrity() -> Response:
        """Prove the KV invariant (free + cached + owned == total); 500 when it is broken."""
        return await control(engine, "check_integrity")

    add_load_routes(app, engine)   # /get_load, /v1/loads: read-only, public
    add_rl_routes(app, engine, admin)
    add_lora_routes(app, engine, admin)
    add_profile_routes(app, engine, admin)
    # vLLM's face: the same engine behind vLLM's routes and shapes
    add_vllm_generate_routes(app, engine, service, admin)
    add_vllm_control_routes(app, engine, admin)
    add_vllm_weight_routes(app, engine, admin)
    add_trl_routes(app, engine, service, admin)   # TRL's `trl vllm-serve` routes
    return app


# -- serving -----------------------------------------------------------------------------------
async def _watch_scheduler(server: Any, engine: Engine, delay: float) -> None:
    """Stop the server ``delay`` seconds after the scheduler dies (``/health`` answers 503
    meanwhile), so a supervisor restarts it instead of it hanging."""
    cfg = engine.config
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"rollout_engine: serving {cfg.model_path} on http://{cfg.host}:{cfg.port}",
          file=sys.stderr, flush=True)
    while engine.tm.dead is None:
        await asyncio.sleep(0.1)
    print(f"rollout_engine: the scheduler died ({engine.tm.dead.splitlines()[0]}); "
          f"exiting in {delay:g} s", file=sys.stderr, flush=True)
    await asyncio.sleep(delay)
    server.should_exit = True


async def _serve(server: Any, engine: Engine) -> None:
    watchdog = asyncio.create_task(
        _watch_scheduler(server, engine, engine.config.dead_scheduler_exit_delay))
    try:
        await server.serve()
    finally:
        watchdog.cancel()


GRACEFUL_S = 3             # open connections' allowance after a stop signal (uvicorn's)
FORCED_STOP_AFTER_S = 6.0   # a stop asked for by a signal that has not ended by then is forced


class ForcedStop:
    """Ends the process ``after_s`` seconds after a stop signal, scheduler processes first,
    whatever the main thread is doing (an event loop blocked for good never runs uvicorn's
    shutdown). A thread started up front waits on a pipe; the signal handler only writes a
    byte to it, which is safe from a handler that interrupted any code."""

    def __init__(self, after_s: float = FORCED_STOP_AFTER_S) -> None:
        self.after_s = after_s
        self._r, self._w = os.pipe()
        threading.Thread(target=self._watch, name="rollout-forced-stop", daemon=True).start()

    def arm(self) -> None:
        try:
            os.write(self._w, b"s")
        except OSError:
            pass   # armed already (the pipe is full) or the process is exiting

    def _watch(self) -> None:
        os.read(self._r, 1)
        time.sleep(self.after_s)   # the orderly stop's allowance: the process ends first if it can
        print(f"rollout_engine: still running {self.after_s:g} s after the stop signal; "
              "killing the scheduler and exiting", file=sys.stderr, flush=True)
        kill_children()
        os._exit(1)


def kill_children() -> None:
    """SIGKILL every process this one started (schedulers, tensor-parallel ranks)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def run_server(config_kwargs: dict[str, Any]) -> int:
    """Serve until interrupted (exit code 0) or until the scheduler dies (exit code 1).

    SIGTERM / SIGINT stop the server in order (open streams get uvicorn's graceful shutdown,
    then the scheduler); a stop that has not ended ``FORCED_STOP_AFTER_S`` seconds after the
    signal kills the scheduler processes and exits with code 1."""
    import uvicorn

    warning = exposure_warning(config_kwargs.get("host", "127.0.0.1"),
                               config_kwargs.get("api_key"))
    if warning is not None:
        logger.warning(warning)
    forced = ForcedStop()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            forced.arm()
            super().handle_exit(sig, frame)

    def terminate(signum: int, frame: Any) -> None:
        forced.arm()
        raise SystemExit(0)   # uvicorn re-raises SIGTERM after its graceful shutdown

    signal.signal(signal.SIGTERM, terminate)
    engine = Engine(**config_kwargs)
    cfg = engine.config
    server = Server(uvicorn.Config(
        create_app(engine), host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
        access_log=False, timeout_graceful_shutdown=GRACEFUL_S))
    died = False
    try:
        asyncio.run(_serve(server, engine))
    except KeyboardInterrupt:
        forced.arm()
    finally:
        died = engine.tm.dead is not None
        engine.shutdown()
    return 1 if died else 0
