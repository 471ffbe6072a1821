"""Control calls, run between batches in arrival order (never during a forward pass).

``ControlDispatcher`` runs a call through a table ``method name -> handler`` built once
(``handlers.py``) and answers it with a ``ControlResult``: a handler's ``ValueError`` /
``TypeError`` is a 400, ``BusyError`` a 409, ``TimeoutError`` a 504, anything else a 500 that
never kills the loop. A call whose caller has already given up (its ``deadline`` passed while it
waited in the queue) is cancelled, not run; its canceller (if the table has one) releases what
the call's payload holds. A handler that must wait on something outside the engine (the
trainer's rendezvous) returns a ``Deferred``: it finishes off the loop, and its answer is sent
from a later step, so generation keeps being served meanwhile.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rollout_engine.protocol.messages import BusyError, ControlReq, ControlResult

logger = logging.getLogger(__name__)

Handler = Callable[..., Any]
"""A control call: takes the call's keyword arguments, returns a JSON-able result (or a
``Deferred``), raises ``ValueError`` (bad input) or ``BusyError`` (not now)."""

Canceller = Callable[[dict[str, Any]], None]
"""Releases what a call's keyword arguments hold when the call is cancelled unrun."""


@dataclass
class Deferred:
    """A call still running off the loop: when ``future`` is done, ``finish(future)`` runs in
    the scheduler thread and returns the call's result (or raises its error)."""

    future: Future
    finish: Callable[[Future], Any]


class ControlDispatcher:
    """Runs control calls through ``handlers``; keeps the deferred ones until they end."""

    def __init__(self, handlers: Mapping[str, Handler],
                 cancellers: Mapping[str, Canceller]) -> None:
        self.handlers = dict(handlers)
        self.cancellers = dict(cancellers)
        self.deferred: list[tuple[ControlReq, Deferred]] = []
        # set by the loop: wakes its wait for messages when a deferred call completes
        self.wake: Callable[[], None] = lambda: None

    def dispatch(self, msg: ControlReq) -> ControlResult | None:
        """The call's result, or None while it is deferred (see ``finished``)."""
        handler = self.handlers.get(msg.method)
        if handler is None:
            return ControlResult(msg.call_id, False, message=f"unknown control call {msg.method!r}",
                                 status=400)
        if msg.deadline is not None and time.time() > msg.deadline:
            cancel = self.cancellers.get(msg.method)
            if cancel is not None:
                cancel(msg.kwargs)
            return ControlResult(msg.call_id, False, status=504, cancelled=True,
                                 message=f"{msg.method} cancelled: its caller's timeout passed "
                                         "before the scheduler reached it; nothing was changed")
        result = self._answer(msg, lambda: handler(**msg.kwargs))
        if isinstance(result.result, Deferred):
            self.deferred.append((msg, result.result))
            result.result.future.add_done_callback(lambda _: self.wake())
            return None
        return result

    def finished(self) -> list[ControlResult]:
        """Answers of deferred calls that completed since the last look (scheduler thread)."""
        done = [(msg, d) for msg, d in self.deferred if d.future.done()]
        if not done:
            return []
        self.deferred = [(msg, d) for msg, d in self.deferred if not d.future.done()]
        return [self._answer(msg, functools.partial(d.finish, d.future)) for msg, d in done]

    @staticmethod
    def _answer(msg: ControlReq, run: Callable[[], Any]) -> ControlResult:
        try:
            result = run()
        except BusyError as e:
            return ControlResult(msg.call_id, False, message=str(e), status=409)
        except (ValueError, TypeError) as e:
            return ControlResult(msg.call_id, False, message=str(e), status=400)
        except TimeoutError as e:
            return ControlResult(msg.call_id, False, message=str(e), status=504)
        except Exception as e:  # noqa: BLE001 - a failed control call must not kill the loop
            # the traceback goes to the server's log; the caller gets what went wrong, not
            # the engine's source paths
            logger.exception("control call %s failed", msg.method)
            return ControlResult(msg.call_id, False, status=500,
                                 message=f"{msg.method} failed: {type(e).__name__}: {e}")
        return ControlResult(msg.call_id, True, result=result)
