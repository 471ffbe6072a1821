"""vLLM's RL control routes on the same engine, in vLLM's shapes: ``/pause``, ``/resume``,
``/is_paused``, ``/abort_requests`` (its RL router), ``/sleep``, ``/wake_up``, ``/is_sleeping``
(its sleep router), ``/reset_prefix_cache`` (its cache router), and the LoRA routes
(``vllm_lora_routes.py``).

    POST /pause?mode=abort|wait|keep&clear_cache=true   -> {"status": "paused"}
    POST /resume                                         -> {"status": "resumed"}
    GET  /is_paused                                      -> {"is_paused": bool}
    POST /abort_requests {"request_ids": [...]}          -> {"status": "aborted", "aborted": n}
    POST /sleep?level=0|1|2&mode=abort|wait|keep         -> {"status": "sleeping", "level": l}
    POST /wake_up?tags=weights&tags=kv_cache             -> {"status": "awake"|"sleeping",
                                                             "tags": [...] | null}
    GET  /is_sleeping                                    -> {"is_sleeping": bool}
    POST /reset_prefix_cache?reset_running_requests=false&reset_external=false
                                                         -> {"success": bool}

The pause modes are ``control/vllm_control.py``'s. ``/sleep`` pauses with ``mode`` (and, from
level 1, a cleared cache), then releases the weights and the KV cache: level 1 keeps the weights
in CPU memory and the wake restores them; level 2 keeps nothing, so after the wake the weights
are stale and generation is refused (503, naming why) until a refit has rewritten every
weight. ``/wake_up`` restores the tags named (none: all; ``scheduling`` names no memory) and,
once nothing is released, resumes generation; staged, a trainer wakes ``weights``, refits, then
wakes ``kv_cache``. As in vLLM, ``/is_sleeping`` is true while paused too. A request that
arrives while memory is released is refused (503) rather than queued.

Failures answer as the vLLM route does: the RL routes ``{"error": message}``, the others
vLLM's ``{"error": {"message", "type", "param", "code"}}``; the status is ours (400 bad input,
409 busy, 503 scheduler gone). The state-changing routes need the admin key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional

from fastapi import FastAPI, Query, Request
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import json_response, read_json
from rollout_engine.entrypoints.vllm_calls import VllmCallError, vllm_call, vllm_error
from rollout_engine.entrypoints.vllm_lora_routes import add_vllm_lora_routes

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

__all__ = ["add_vllm_control_routes"]

PauseMode = Literal["abort", "wait", "keep"]
MEMORY_TAGS = ("weights", "kv_cache")   # what vLLM's sleep releases; "scheduling": no memory


def _rl_error(e: VllmCallError) -> Response:
    return json_response({"error": e.message}, e.status)


def add_vllm_control_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register vLLM's control routes; ``admin`` is the admin-key dependency list."""

    @app.post("/pause", dependencies=admin)
    async def pause(mode: PauseMode = Query("abort"),
                    clear_cache: bool = Query(True)) -> Response:
        try:
            await vllm_call(engine, "vllm_pause", mode=mode, clear_cache=clear_cache)
        except VllmCallError as e:
            return _rl_error(e)
        return json_response({"status": "paused"})

    @app.post("/resume", dependencies=admin)
    async def resume() -> Response:
        try:
            await vllm_call(engine, "vllm_resume")
        except VllmCallError as e:
            return _rl_error(e)
        return json_response({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        try:
            state = await vllm_call(engine, "vllm_pause_state")
        except VllmCallError as e:
            return _rl_error(e)
        return json_response({"is_paused": state["paused"]})

    @app.post("/abort_requests", dependencies=admin)
    async def abort_requests(request: Request) -> Response:
        """vLLM's: abort the named requests (our rids), or every one for none."""
        body = await read_json(request, optional=True)
        ids = body.get("request_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, str) for i in ids)):
            return json_response({"error": "request_ids: must be a list of request id "
                                           f"strings, got {ids!r}"}, 400)
        tm = engine.tm
        if tm.dead is not None:
            return json_response({"error": f"the scheduler died: {tm.dead.splitlines()[0]}"},
                                 503)
        if ids:
            for rid in ids:
                tm.abort(rid=rid)
            return json_response({"status": "aborted", "aborted": len(ids)})
        count = len(tm.states)
        tm.abort(abort_all=True)
        return json_response({"status": "aborted", "aborted": count})

    @app.post("/sleep", dependencies=admin)
    async def sleep(level: int = Query(1, ge=0, le=2),
                    mode: PauseMode = Query("abort")) -> Response:
        """``tags`` in the query (SkyRL sends it) are ignored, as vLLM ignores them."""
        try:
            await vllm_call(engine, "vllm_pause", mode=mode, clear_cache=level >= 1)
            if level >= 1:
                await vllm_call(engine, "release_memory_occupation", tags=list(MEMORY_TAGS),
                                weights_backup=level == 1)
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        return json_response({"status": "sleeping", "level": level})

    @app.post("/wake_up", dependencies=admin)
    async def wake_up(request: Request) -> Response:
        raw = request.query_params.getlist("tags")
        tags: Optional[list[str]] = raw or None
        unknown = sorted(set(raw) - {*MEMORY_TAGS, "scheduling"})
        if unknown:
            return vllm_error(400, f"tags: unknown tag(s) {unknown}; vLLM's tags are "
                                   f"{[*MEMORY_TAGS, 'scheduling']}", param="tags")
        memory = list(MEMORY_TAGS) if tags is None else [t for t in tags if t in MEMORY_TAGS]
        try:
            if memory:
                state = await vllm_call(engine, "resume_memory_occupation", tags=memory)
            else:
                state = await vllm_call(engine, "vllm_pause_state")
            awake = not set(state["released"]) & set(MEMORY_TAGS)
            if awake:
                await vllm_call(engine, "vllm_resume")
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        return json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        try:
            state = await vllm_call(engine, "vllm_pause_state")
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        asleep = state["paused"] or bool(set(state["released"]) & set(MEMORY_TAGS))
        return json_response({"is_sleeping": asleep})

    @app.post("/reset_prefix_cache", dependencies=admin)
    async def reset_prefix_cache(reset_running_requests: bool = Query(False),
                                 reset_external: bool = Query(False)) -> Response:
        """The flags are query parameters, as vLLM reads them (a JSON body is ignored)."""
        try:
            r = await vllm_call(engine, "reset_prefix_cache",
                                reset_running_requests=reset_running_requests,
                                reset_external=reset_external)
        except VllmCallError as e:
            return vllm_error(e.status, e.message)
        return json_response({"success": bool(r["success"])})

    add_vllm_lora_routes(app, engine, admin)
