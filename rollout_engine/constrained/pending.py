"""Requests waiting for their grammar to compile (the scheduler's grammar queue).

The scheduler adds a request with its compile future when it receives it, polls once per loop
iteration (never blocking), moves the ready ones to its waiting queue, and ends the failed ones
with their error. Generic over the request type: nothing here knows the scheduler's ``Req``.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rollout_engine.constrained.matcher import Grammar

__all__ = ["GrammarQueue", "Polled"]

R = TypeVar("R")


@dataclass
class Polled(Generic[R]):
    """One poll: requests whose grammar is ready, and those whose compile failed."""

    ready: list[tuple[R, Grammar]] = field(default_factory=list)
    failed: list[tuple[R, str]] = field(default_factory=list)


class GrammarQueue(Generic[R]):
    """FIFO of (request, compile future); a request leaves when its future is done."""

    def __init__(self) -> None:
        self._items: list[tuple[R, Future[Grammar]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, req: R, future: Future[Grammar]) -> None:
        self._items.append((req, future))

    def futures(self) -> list[Future[Grammar]]:
        """The compiles still awaited (to wait on them)."""
        return [f for _, f in self._items]

    def remove(self, req: R) -> bool:
        """Drop ``req`` (aborted while compiling). The compile itself runs on: it is cached and
        may serve other requests."""
        before = len(self._items)
        self._items = [(r, f) for r, f in self._items if r is not req]
        return len(self._items) != before

    def poll(self) -> Polled[R]:
        """Take every request whose future is done, in arrival order; never blocks."""
        out: Polled[R] = Polled()
        keep: list[tuple[R, Future[Grammar]]] = []
        for req, fut in self._items:
            if not fut.done():
                keep.append((req, fut))
                continue
            try:
                out.ready.append((req, fut.result()))
            except Exception as e:  # noqa: BLE001 - the compile's error ends this request only
                out.failed.append((req, str(e) or type(e).__name__))
        self._items = keep
        return out
