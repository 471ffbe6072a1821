"""A small asyncio client of the engine's HTTP routes, shared by the server actor (generation
and control) and the trainer-side adapter (sleep, wake and refit).

Errors: a refused call (an HTTP error status, or ``success: false``) raises `EngineCallError`
with the route, the status and the server's own message; a connection failure raises httpx's
error."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Optional

import httpx

__all__ = ["CONTROL_TIMEOUT_S", "EngineCallError", "EngineHttp"]

CONTROL_TIMEOUT_S = 600.0
"""A control call's limit (a refit of a large bucket, a sleep that frees many GiB)."""


class EngineCallError(RuntimeError):
    """The engine answered a call with an error (``status``: the HTTP status)."""

    def __init__(self, route: str, status: int, message: str) -> None:
        super().__init__(f"rollout_engine {route}: HTTP {status}: {message}")
        self.route, self.status, self.message = route, status, message


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return response.text[:2000]


class EngineHttp:
    """Calls to one server at ``base_url`` (``http://host:port``). One pooled connection set
    per event loop: a Ray async actor keeps one loop, and a caller that runs each call in a new
    loop gets a fresh pool rather than one bound to a closed loop."""

    def __init__(self, base_url: str, api_key: Optional[str] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: Optional[httpx.AsyncClient] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _pool(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                             limits=limits, timeout=CONTROL_TIMEOUT_S)
            self._loop = loop
        return self._client

    async def call(self, route: str, body: Optional[Mapping[str, Any]] = None, *,
                   method: str = "POST", timeout_s: Optional[float] = CONTROL_TIMEOUT_S) -> Any:
        """``method route`` with a JSON ``body``; the decoded answer. ``timeout_s`` None waits
        as long as the server takes (generation)."""
        client = self._pool()
        if method == "GET":
            response = await client.get(route, timeout=timeout_s)
        else:
            response = await client.post(route, json=dict(body or {}), timeout=timeout_s)
        if response.status_code >= 400:
            raise EngineCallError(route, response.status_code, _message(response))
        answer = response.json()
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineCallError(route, response.status_code, str(answer.get("message")))
        return answer

    async def aclose(self) -> None:
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._loop = None
