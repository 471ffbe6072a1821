"""Control calls, run between batches in arrival order (never during a forward pass)."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

from rollout_engine.protocol.messages import ControlReq, ControlResult

if TYPE_CHECKING:
    from rollout_engine.scheduler.scheduler import Scheduler


class BusyError(RuntimeError):
    """The call cannot run while requests are in flight (HTTP 409)."""


class ControlHandlers:
    """One ``rpc_<method>`` per control call; each returns a JSON-able result or raises
    ``ValueError`` (bad input, 400) / ``BusyError`` (409)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def dispatch(self, msg: ControlReq) -> ControlResult:
        handler = (getattr(self, f"rpc_{msg.method}", None)
                   or getattr(self.s.rl, f"rpc_{msg.method}", None))
        if handler is None:
            return ControlResult(msg.call_id, False, message=f"unknown control call {msg.method!r}",
                                 status=400)
        try:
            result = handler(**msg.kwargs)
        except BusyError as e:
            return ControlResult(msg.call_id, False, message=str(e), status=409)
        except (ValueError, TypeError) as e:
            return ControlResult(msg.call_id, False, message=str(e), status=400)
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
            "paused": s.paused,
            "released_memory": sorted(s.memory_saver.released),
            "weights_stale": s.weights_stale,
            "kv_pool_bytes": s.runner.kv_pool.nbytes(),
            "weight_bytes": s.runner.weight_nbytes(),
            "stats": dict(s.stats),
        }
