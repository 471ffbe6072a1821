"""The vLLM face's control calls and error bodies: a scheduler control call whose failure is an
exception carrying its HTTP status, and vLLM's ``ErrorResponse`` JSON."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Optional

from starlette.responses import Response

from rollout_engine.control.call_types import coerce_call
from rollout_engine.entrypoints.http_utils import json_response
from rollout_engine.tokenizer_manager import SchedulerDeadError

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

__all__ = ["VllmCallError", "vllm_call", "vllm_error"]


class VllmCallError(Exception):
    """A control call that failed: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def vllm_call(engine: Engine, method: str, **kwargs: Any) -> Any:
    """Run a scheduler control call; its result, or ``VllmCallError`` with its status."""
    try:
        kwargs = coerce_call(method, kwargs)
    except ValueError as e:
        raise VllmCallError(400, str(e)) from None
    try:
        r = await engine.tm.async_call(method, **kwargs)
    except SchedulerDeadError as e:
        raise VllmCallError(503, str(e)) from None
    if not r.success:
        raise VllmCallError(r.status, r.message or f"{method} failed")
    return r.result


def vllm_error(status: int, message: str, err_type: Optional[str] = None,
               param: Optional[str] = None) -> Response:
    """vLLM's ``ErrorResponse`` body."""
    kind = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return json_response({"error": {"message": message, "type": kind, "param": param,
                                    "code": status}}, status)
