"""`TimedEngine`: an engine as `RolloutFleet`'s syncer sees it, noting when its weight updates
are answered (a refit's per-engine seconds) and which are still in flight (after a failed
refit the fleet waits for them before it quarantines: an engine refuses to sleep while it is
still receiving)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["UPDATE_METHODS", "TimedEngine"]

UPDATE_METHODS = ("update_weights_from_distributed", "update_weights_from_tensor",
                  "update_weights_from_disk")


class TimedEngine:
    """An engine as the fleet's syncer sees it: the same methods, the time its last
    weight-update call answered (a refit's per-engine seconds), and how many update calls it
    has been sent that are not answered yet."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.answered: Optional[float] = None
        self.pending = 0
        self.idle = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name not in UPDATE_METHODS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._sent()
            return self._answer(lambda: attr(*args, **kwargs))
        return call

    def send_call(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """The engine's own `send_call` (calls reach it in send order: transports.base
        .start_call), timed; an engine without one is called when the answer is awaited."""
        if not callable(getattr(type(self.engine), "send_call", None)):
            call = getattr(self, method)
            return lambda: call(*args, **kwargs)
        if method not in UPDATE_METHODS:
            return self.engine.send_call(method, *args, **kwargs)
        self._sent()
        try:
            answer = self.engine.send_call(method, *args, **kwargs)
        except BaseException:
            self._answer(lambda: None)
            raise
        return lambda: self._answer(answer)

    def _sent(self) -> None:
        with self.idle:
            self.pending += 1

    def _answer(self, wait: Callable[[], Any]) -> Any:
        try:
            result = wait()
            self.answered = time.perf_counter()
            return result
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def wait_answered(self, timeout_s: float) -> bool:
        """Wait until every update call sent has been answered (after a failed refit some are
        still in flight, and an engine refuses to sleep while it is still receiving one)."""
        with self.idle:
            return self.idle.wait_for(lambda: self.pending == 0, max(0.0, timeout_s))

    def seconds_since(self, start: float, default: float) -> float:
        """Seconds from `start` to the last update answer (`default` if none came since)."""
        if self.answered is None or self.answered < start:
            return default
        return self.answered - start
