"""One request's outputs on the frontend, and the stream a caller iterates over.

    receiver thread --(chunks, final | error)--> RequestState --(wait | ChunkStream)--> caller
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.detokenizer import IncrementalDetokenizer
from rollout_engine.protocol.messages import GenerateReq


class SchedulerDeadError(RuntimeError):
    """The scheduler is gone; nothing can be served (HTTP 503)."""


@dataclass
class RequestState:
    """Outputs of one request as they arrive; waited on by threads or asyncio tasks."""

    req: GenerateReq
    detok: IncrementalDetokenizer
    created: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)   # stream chunks not yet taken
    final: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()
            waiters = list(self.waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # that loop is closed; its caller is gone

    def take_pending(self) -> list[dict[str, Any]]:
        with self.cond:
            chunks, self.pending = self.pending, []
        return chunks

    async def changed(self) -> None:
        """Return once a chunk is pending or the request is done."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self.cond:
            if self.pending or self.done:
                return
            self.waiters.append((loop, event))
        try:
            await event.wait()
        finally:
            with self.cond:
                self.waiters.remove((loop, event))


class ChunkStream:
    """The chunks of one streaming request, for ``for`` and ``async for``.

    Closing the stream before the request finishes aborts the request, so the scheduler stops
    decoding it and frees its KV: ``close()`` / ``aclose()``, leaving a ``with`` block, or
    dropping the stream (``break`` out of ``for chunk in engine.generate(..., stream=True)``,
    garbage collection). A dead scheduler raises ``SchedulerDeadError`` after the last chunk.
    """

    def __init__(self, st: RequestState, abort: Callable[[str], None]) -> None:
        self.st = st
        self._abort = abort
        self._buf: deque[dict[str, Any]] = deque()
        self.closed = False

    def _next(self) -> Optional[dict[str, Any]]:
        """The next chunk; None when none is there yet. Raises at the end of the stream."""
        if not self._buf and not self.closed:
            self._buf.extend(self.st.take_pending())
        if self._buf:
            return self._buf.popleft()
        if self.closed:
            raise StopIteration
        if self.st.error is not None:
            self.closed = True
            raise SchedulerDeadError(self.st.error)
        if self.st.done:
            self.closed = True
            raise StopIteration
        return None

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> dict[str, Any]:
        st = self.st
        while True:
            chunk = self._next()
            if chunk is not None:
                return chunk
            with st.cond:
                st.cond.wait_for(lambda: bool(st.pending) or st.done)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            try:
                chunk = self._next()
            except StopIteration:
                raise StopAsyncIteration from None
            if chunk is not None:
                return chunk
            await self.st.changed()

    def close(self) -> None:
        """Stop reading; abort the request unless it already finished."""
        if self.closed:
            return
        self.closed = True
        self._buf.clear()
        if not self.st.done:
            self._abort(self.st.req.rid)

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown or a dead channel
            pass
