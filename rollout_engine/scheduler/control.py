"""Control calls, run between batches in arrival order (never during a forward pass).

A call whose caller has already given up (its ``deadline`` passed while it waited in the queue)
is cancelled, not run. A handler that must wait on something outside the engine (the trainer's
rendezvous) returns a ``Deferred``: it finishes off the loop, and its answer is sent from a
later step, so generation keeps being served meanwhile.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_engine.protocol.messages import ControlReq, ControlResult

if TYPE_CHECKING:
    from rollout_engine.scheduler.scheduler import Scheduler


class BusyError(RuntimeError):
    """The call cannot run while requests are in flight (HTTP 409)."""


@dataclass
class Deferred:
    """A call still running off the loop: when ``future`` is done, ``finish(future)`` runs in
    the scheduler thread and returns the call's result (or raises its error)."""

    future: Future
    finish: Callable[[Future], Any]


class ControlHandlers:
    """One ``rpc_<method>`` per control call; each returns a JSON-able result (or a
    ``Deferred``) or raises ``ValueError`` (bad input, 400) / ``BusyError`` (409)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.deferred: list[tuple[ControlReq, Deferred]] = []

    def dispatch(self, msg: ControlReq) -> ControlResult | None:
        """The call's result, or None while it is deferred (see ``finished``)."""
        handler = (getattr(self, f"rpc_{msg.method}", None)
                   or getattr(self.s.rl, f"rpc_{msg.method}", None))
        if handler is None:
            return ControlResult(msg.call_id, False, message=f"unknown control call {msg.method!r}",
                                 status=400)
        if msg.deadline is not None and time.time() > msg.deadline:
            return ControlResult(msg.call_id, False, status=504, cancelled=True,
                                 message=f"{msg.method} cancelled: its caller's timeout passed "
                                         "before the scheduler reached it; nothing was changed")
        result = self._answer(msg, lambda: handler(**msg.kwargs))
        if isinstance(result.result, Deferred):
            self.deferred.append((msg, result.result))
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
            return ControlResult(msg.call_id, False, status=500,
                                 message=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return ControlResult(msg.call_id, True, result=result)

    # -- cache and introspection ---------------------------------------------------------------
    def rpc_flush_cache(self) -> dict[str, Any]:
        if self.s.has_work:
            raise BusyError(f"cannot flush the cache while {len(self.s.by_rid)} request(s) are "
                            "in flight; retry when idle")
        self.s.kv.tree.reset()
        return {"flushed": True}

    def rpc_check_integrity(self) -> dict[str, Any]:
        return self.s.check_integrity()

    def rpc_get_server_info(self) -> dict[str, Any]:
        s = self.s
        return {
            "max_total_num_tokens": s.runner.max_total_num_tokens,
            "max_running_requests": s.runner.max_running_requests,
            "context_length": s.runner.context_len,
            "architectures": [s.runner.arch.architecture],
            "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting),
            "kv_free_tokens": s.allocator.available_size(),
            "kv_cached_tokens": s.kv.tree.total_size(),
            "weight_version": s.weight_version,
            "weight_generation": s.rl.generation,
            "paused": s.paused,
            "released_memory": sorted(s.memory_saver.released),
            "weights_stale": s.weights_stale,
            "weights_missing": len(s.rl.missing_weights),
            "flush_pending": s.rl.flush_pending,
            "pending_weight_update_groups": sorted(s.update_groups.pending),
            "kv_pool_bytes": s.runner.kv_pool.nbytes(),
            "weight_bytes": s.runner.weight_nbytes(),
            "stats": dict(s.stats),
        }
