"""Control calls, run between batches in arrival order (never during a forward pass).

A call whose caller has already given up (its ``deadline`` passed while it waited in the queue)
is cancelled, not run. A handler that must wait on something outside the engine (the trainer's
rendezvous) returns a ``Deferred``: it finishes off the loop, and its answer is sent from a
later step, so generation keeps being served meanwhile.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_engine.protocol.messages import ControlReq, ControlResult

if TYPE_CHECKING:
    from rollout_engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


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
        # set by the loop: wakes its wait for messages when a deferred call completes
        self.wake: Callable[[], None] = lambda: None
        self.throughput = ThroughputMeter()

    def dispatch(self, msg: ControlReq) -> ControlResult | None:
        """The call's result, or None while it is deferred (see ``finished``)."""
        handler = (getattr(self, f"rpc_{msg.method}", None)
                   or getattr(self.s.rl, f"rpc_{msg.method}", None))
        if handler is None:
            return ControlResult(msg.call_id, False, message=f"unknown control call {msg.method!r}",
                                 status=400)
        if msg.deadline is not None and time.time() > msg.deadline:
            if msg.method == "update_weights_from_tensor" and not msg.kwargs.get(
                    "read_by_others"):
                # never read: drop the references a torch-protocol sender took for its reader
                from rollout_engine.weights.refit import drop_unread

                drop_unread(self.s.runner.model, msg.kwargs.get("serialized_named_tensors"))
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

    # -- cache and introspection ---------------------------------------------------------------
    def rpc_flush_cache(self) -> dict[str, Any]:
        if self.s.has_work:
            raise BusyError(f"cannot flush the cache while {len(self.s.by_rid)} request(s) are "
                            "in flight; retry when idle")
        self.s.kv.flush()
        return {"flushed": True}

    def rpc_check_integrity(self) -> dict[str, Any]:
        return self.s.check_integrity()

    def rpc_get_server_info(self) -> dict[str, Any]:
        """Runtime state, under our names and SGLang's (its ``scheduler_info`` keys and what its
        scheduler puts in ``internal_states``); the frontend adds the flags."""
        s = self.s
        load = self.rpc_get_load()
        return {
            "status": "ready",
            "max_req_input_len": min(s.runner.context_len, s.runner.max_total_num_tokens) - 1,
            "internal_state": {
                "last_gen_throughput": load.gen_throughput,
                "memory_usage": {"weight": round(load.weight_gb, 2),
                                 "kvcache": round(load.kv_cache_gb, 2),
                                 "token_capacity": load.max_total_num_tokens,
                                 "graph": 0.0},
                "effective_max_running_requests_per_dp": load.max_running_requests,
            },
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
            "weight_updates_receiving": s.update_groups.receiving(),
            "weight_update_buffer_bytes": s.update_groups.buffer_bytes() + (
                s.rl.shadow.num_bytes if s.rl.shadow is not None else 0),
            "kv_pool_bytes": s.runner.kv_pool.nbytes(),
            "weight_bytes": s.runner.weight_nbytes(),
            "stats": dict(s.stats),
            "hicache": s.kv.tree.tier_stats(),   # None without lower cache tiers
        }

    def rpc_get_load(self) -> LoadReport:
        """The numbers behind SGLang's ``/get_load`` and ``/v1/loads``."""
        s = self.s
        max_tokens = s.runner.max_total_num_tokens
        active = s.active_reqs()        # running, and the request whose prompt is being chunked
        unprefilled = [*s.waiting, *([s.chunked] if s.chunked is not None else [])]
        held = len(active) + len(s.waiting) if s.paused else 0
        stats = s.stats
        return LoadReport(
            num_running_reqs=len(active), num_waiting_reqs=len(s.waiting),
            num_used_tokens=max_tokens - s.kv.available_tokens(),
            num_waiting_tokens=sum(req.seq_len for req in s.waiting),
            num_waiting_uncached_tokens=sum(req.seq_len - req.kv_len for req in unprefilled),
            max_total_num_tokens=max_tokens, max_running_requests=s.runner.max_running_requests,
            gen_throughput=self.throughput.sample(stats["decode_tokens"], time.monotonic()),
            cache_hit_rate=(stats["cached_tokens"] / stats["prompt_tokens"]
                            if stats["prompt_tokens"] else 0.0),
            num_paused_reqs=held,
            num_retracted_reqs=sum(1 for req in s.waiting if req.output_ids),
            total_prefill_tokens=stats["prefill_tokens"],
            weight_gb=s.runner.weight_nbytes() / 2**30,
            kv_cache_gb=s.runner.kv_pool.nbytes() / 2**30,
            timestamp=time.time())


@dataclass(frozen=True)
class LoadReport:
    """One scheduler's load (SGLang's per-DP-rank load; we have one rank, 0)."""

    num_running_reqs: int              # incl. the one being prefilled in chunks
    num_waiting_reqs: int
    num_used_tokens: int               # KV slots owned by requests (not the evictable cache)
    num_waiting_tokens: int            # prompt + output tokens of the waiting queue
    num_waiting_uncached_tokens: int   # not yet in KV: waiting, and the chunked prompt's rest
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float              # decode tokens/s (see ThroughputMeter)
    cache_hit_rate: float              # prompt tokens served from the radix cache, since start
    num_paused_reqs: int               # held by pause_generation
    num_retracted_reqs: int            # waiting with output already (retracted)
    total_prefill_tokens: int          # prompt tokens computed (not served from cache), since start
    weight_gb: float
    kv_cache_gb: float
    timestamp: float

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens \
            else 0.0

    @property
    def utilization(self) -> float:
        """SGLang's: max(running / max running, token usage / 0.9)."""
        return max(self.num_running_reqs / max(self.max_running_requests, 1),
                   self.token_usage / 0.9)


class ThroughputMeter:
    """Tokens per second over the window since the previous sample at least ``window_s`` old
    (SGLang's ``last_gen_throughput`` is measured over its last logging interval)."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self.since, self.tokens_then = time.monotonic(), 0
        self.rate = 0.0

    def sample(self, tokens: int, now: float) -> float:
        if now - self.since >= self.window_s:
            self.rate = (tokens - self.tokens_then) / (now - self.since)
            self.since, self.tokens_then = now, tokens
        return self.rate
