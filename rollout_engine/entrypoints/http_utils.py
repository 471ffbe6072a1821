"""The JSON edge of the HTTP server: body parsing, JSON / SSE rendering, error bodies, API keys,
and the generic control-call proxy.

Every error a client can trigger leaves here as ``{"error": {"message": ...}}`` with the status
API.md gives it: 400 bad input, 401 bad key, 404 unknown route, 409 busy, 413 body too large,
503 scheduler dead or engine full.
"""

from __future__ import annotations

import asyncio
import email.message
import hmac
import ipaddress
import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from rollout_engine.control.call_types import coerce_call
from rollout_engine.protocol.messages import WeightSlice
from rollout_engine.tokenizer_manager import (
    EngineAsleepError,
    EngineBusyError,
    EngineOverloadedError,
    SchedulerDeadError,
)

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


class HTTPError(Exception):
    """Raised by route code to answer ``status`` with an error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# -- rendering ---------------------------------------------------------------------------------
def _finite(obj: Any) -> Any:
    """Replace NaN / +-inf (not JSON) with None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    """Strict JSON as UTF-8; non-finite floats become null, lone surrogates are escaped."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed back from the request
        return json.dumps(_finite(obj), ensure_ascii=True, separators=(",", ":")).encode()


def json_response(content: Any, status: int = 200) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json")


def error_response(status: int, message: str, **extra: Any) -> Response:
    return json_response({"error": {"message": message, "code": status}, **extra}, status)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends (finished, client gone, cancelled), so
    the iterator's ``finally`` aborts unfinished requests right away instead of at GC time."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse_response(body: Any) -> Response:
    return ClosingStreamingResponse(body, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


# -- parsing -----------------------------------------------------------------------------------
async def read_json(request: Request, optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object. A missing Content-Type is read as JSON; any other type is a 400.
    With ``optional``, an empty body is ``{}``."""
    ctype = request.headers.get("content-type")
    if ctype:
        msg = email.message.Message()
        msg["content-type"] = ctype
        sub = msg.get_content_subtype()
        if msg.get_content_maintype() != "application" or not (sub == "json"
                                                               or sub.endswith("+json")):
            raise HTTPError(400, f"Content-Type {ctype!r} is not supported; send a JSON object "
                                 "with Content-Type: application/json")
    raw = await request.body()
    if not raw.strip():
        if optional:
            return {}
        raise HTTPError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the request body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_fields(body: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise HTTPError(400, f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not loc:
            parts.append("request body: must be a JSON object sent with "
                         "Content-Type: application/json")
            continue
        parts.append(f"{'.'.join(loc)}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


# -- limits ------------------------------------------------------------------------------------
class BodyLimitMiddleware:
    """Answer 413 to a request body over its route's limit, counting bytes as they arrive: a
    declared Content-Length over it is refused before reading, a chunked body as soon as it
    passes it, so no route ever buffers an unbounded body."""

    def __init__(self, app: Any, limit: int, route_limits: Mapping[str, int]) -> None:
        self.app = app
        self.limit = limit
        self.route_limits = dict(route_limits)

    def _message(self, path: str, limit: int) -> str:
        flag = "--max-refit-body-bytes" if path in self.route_limits else "--max-request-body-bytes"
        return f"the request body is larger than {limit} bytes, the limit of {path} (see {flag})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.route_limits.get(path, self.limit)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await error_response(413, self._message(path, limit))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPError(413, self._message(path, limit))
            return message

        await self.app(scope, limited_receive, send)


def exposure_warning(host: str, api_key: Optional[str]) -> Optional[str]:
    """The warning to log when ``host`` is reachable from other machines and no API key guards
    the routes; None when the server is safe (a loopback address, or a key is set)."""
    if api_key is not None:
        return None
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass   # a host name: it may resolve to any interface
    return (f"serving on {host!r} without an API key: anyone who can reach this address can "
            "generate, and (without --admin-api-key) refit, release or pause the engine; set "
            "--api-key (and --admin-api-key), or bind 127.0.0.1")


# -- API keys ----------------------------------------------------------------------------------
class APIKeys:
    """``api_key`` guards every route (the admin key also passes); ``admin_api_key`` guards the
    control routes (falling back to ``api_key`` when no admin key is set)."""

    def __init__(self, api_key: Optional[str], admin_api_key: Optional[str]) -> None:
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    @staticmethod
    def _presented(request: Request) -> Optional[bytes]:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip().encode("utf-8", "surrogateescape")

    @staticmethod
    def _matches(token: Optional[bytes], key: Optional[str]) -> bool:
        return token is not None and key is not None and hmac.compare_digest(token, key.encode())

    def require_user(self, request: Request) -> None:
        if self.api_key is None:
            return
        token = self._presented(request)
        if not (self._matches(token, self.api_key) or self._matches(token, self.admin_api_key)):
            raise HTTPError(401, "missing or wrong API key; send 'Authorization: Bearer KEY'")

    def require_admin(self, request: Request) -> None:
        key = self.admin_api_key if self.admin_api_key is not None else self.api_key
        if key is None:
            return
        if not self._matches(self._presented(request), key):
            raise HTTPError(401, "this is a control route: send 'Authorization: Bearer "
                                 "ADMIN_KEY' (the --admin-api-key)")


# -- control calls -----------------------------------------------------------------------------
async def control(engine: Engine, method: str, status_map: Optional[Mapping[int, int]] = None,
                  lift: tuple[str, ...] = (), **kwargs: Any) -> Response:
    """Proxy one scheduler control call: ``{"success", "message"[, "result"]}`` with the call's
    status (200, 400 bad input, 409 busy, 503 dead, 504 timeout), remapped by ``status_map``.
    ``kwargs`` are first coerced to the call's declared types as SGLang's request models coerce
    a body (``control/call_types.py``: ``"29500"`` for an int, ``"false"`` for a bool); a value
    that does not coerce is a 400 naming the field. ``lift``: keys of a dict result that are
    also put at the top of the body (where SGLang's answer has them)."""
    try:
        kwargs = coerce_call(method, kwargs)
    except ValueError as e:
        return json_response({"success": False, "message": str(e), "status": "error",
                              "error": {"message": str(e), "code": 400}}, 400)
    try:
        r = await engine.tm.async_call(method, **kwargs)
    except SchedulerDeadError as e:
        return error_response(503, str(e), success=False, message=str(e))
    status = (status_map or {}).get(r.status, r.status)
    message = r.message or ("ok" if r.success else f"{method} failed")
    # SGLang's pause / continue routes answer {"status": "ok", "message"}; the update routes
    # {"success", "message"}: every control answer carries both
    body: dict[str, Any] = {"success": r.success, "message": message,
                            "status": "ok" if r.success else "error"}
    if isinstance(r.result, WeightSlice):   # lists of up to 2^20 floats: not on the event loop
        body["result"] = await asyncio.to_thread(r.result.tolist)
    elif r.result is not None:
        body["result"] = r.result
        if isinstance(r.result, dict):
            body.update({k: r.result[k] for k in lift if k in r.result})
    if not r.success:
        body["error"] = {"message": message, "code": status}
    return json_response(body, status)


# -- exception handlers ------------------------------------------------------------------------
def install_error_handlers(app: FastAPI, engine: Engine) -> None:
    """Map every exception to a JSON error body; nothing a client sends may produce a crash."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> Response:
        return error_response(e.status, e.message)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException) -> Response:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"no route {request.url.path!r}; see /openapi.json for the routes"
        return error_response(e.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> Response:
        return error_response(400, _validation_message(list(e.errors())))

    @app.exception_handler(pydantic.ValidationError)
    async def _pydantic_validation(request: Request, e: pydantic.ValidationError) -> Response:
        return error_response(400, _validation_message(list(e.errors())))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError) -> Response:
        return error_response(400, str(e) or type(e).__name__)

    @app.exception_handler(RecursionError)
    async def _recursion(request: Request, e: RecursionError) -> Response:
        return error_response(400, "the request is nested too deeply")

    @app.exception_handler(SchedulerDeadError)
    async def _dead(request: Request, e: SchedulerDeadError) -> Response:
        return error_response(503, str(e))

    @app.exception_handler(EngineAsleepError)
    async def _asleep(request: Request, e: EngineAsleepError) -> Response:
        return error_response(503, str(e))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, e: EngineOverloadedError) -> Response:
        response = error_response(503, str(e))
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(EngineBusyError)
    async def _busy(request: Request, e: EngineBusyError) -> Response:
        return error_response(409, str(e))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        if engine.tm.dead is not None:
            return error_response(503, f"the scheduler died: {engine.tm.dead.splitlines()[0]}")
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
