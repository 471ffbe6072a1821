"""vLLM's pause modes and prefix-cache reset, as control calls over the scheduler.

vLLM's ``pause_generation(mode, clear_cache)`` (``PauseMode``) on our scheduler:

    abort   every request (running and queued) is aborted; generation pauses
    keep    clear_cache false: the running requests freeze with their KV (our ``in_place``);
            clear_cache true (vLLM's default): vLLM resets the prefix cache with its running
            requests preempted, so they give their KV back and are recomputed from their
            tokens on resume (our ``retract``), under whatever weights are loaded by then
    wait    nothing new is admitted from the queue while the requests holding KV run to their
            end (``Serving.draining``); the call is answered once none is left (a ``Deferred``
            completed by ``poll`` after a step), and generation is then paused

In every mode requests that arrive while paused wait in the queue (as vLLM queues them) and
run after ``vllm_resume``; ``clear_cache`` empties the prefix cache once the pause holds no KV.
A resume while a ``wait`` pause is still draining answers that pause 409.

``reset_prefix_cache`` is vLLM's: without ``reset_running_requests`` it empties the prefix cache
only when no request holds KV (``success`` false otherwise, nothing changed); with it, the
requests holding KV are first retracted (recomputed from their tokens).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from rollout_engine.control.dispatch import Deferred
from rollout_engine.control.rl_control import RLControl
from rollout_engine.control.serving import Serving
from rollout_engine.protocol.messages import BusyError
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.weight_state import WeightState

__all__ = ["VLLM_PAUSE_MODES", "VllmControl"]

VLLM_PAUSE_MODES = ("abort", "wait", "keep")


class VllmControl:
    """vLLM's pause / resume / cache-reset calls over the scheduler's request side, its KV
    manager and weight state; pausing itself is ``rl``'s (``pause_generation``)."""

    def __init__(self, serving: Serving, kv: KVManager, weights: WeightState,
                 rl: RLControl) -> None:
        self.serving = serving
        self.kv = kv
        self.weights = weights
        self.rl = rl
        self.drains: list[Future[None]] = []   # ``wait`` pauses not answered yet

    # -- pause ---------------------------------------------------------------------------------
    def rpc_vllm_pause(self, mode: str = "abort", clear_cache: bool = True) -> Any:
        """vLLM's ``pause_generation`` (module docstring); a ``wait`` that has requests to
        drain answers later (``Deferred``)."""
        if mode not in VLLM_PAUSE_MODES:
            raise ValueError(f"mode: must be one of {list(VLLM_PAUSE_MODES)}, got {mode!r}")
        if not isinstance(clear_cache, bool):
            raise ValueError(f"clear_cache: must be true or false, got {clear_cache!r}")
        s = self.serving
        if mode == "wait" and s.active_reqs():
            s.paused = False    # requests frozen by an earlier pause drain too (vLLM's PAUSED_NEW)
            s.draining = True
            future: Future[None] = Future()
            self.drains.append(future)
            return Deferred(future, lambda f: self._paused(f.result(), mode, clear_cache))
        if mode == "abort":
            self.rl.rpc_pause_generation("abort")
        elif mode == "keep":
            self.rl.rpc_pause_generation("retract" if clear_cache else "in_place")
        else:
            s.paused = True
        return self._paused(None, mode, clear_cache)

    def _paused(self, _: None, mode: str, clear_cache: bool) -> dict[str, Any]:
        s = self.serving
        if clear_cache and not s.active_reqs():
            self.kv.flush()
            self.weights.flush_pending = False
        return {"paused": True, "mode": mode, "cache_cleared": clear_cache,
                "num_held": len(s.by_rid)}

    def poll(self) -> None:
        """After every step: a ``wait`` pause whose requests have all ended pauses and is
        answered; one whose drain was ended by a resume is answered 409."""
        if not self.drains:
            return
        s = self.serving
        if s.draining and s.active_reqs():
            return
        drains, self.drains = self.drains, []
        if not s.draining:
            for f in drains:
                f.set_exception(BusyError("pause(mode='wait'): generation was resumed before "
                                          "the in-flight requests finished"))
            return
        s.draining = False
        s.paused = True
        for f in drains:
            f.set_result(None)

    def rpc_vllm_resume(self) -> dict[str, Any]:
        """vLLM's ``resume_generation``: queued and frozen requests run again (those that could
        never run, asleep or on stale weights, are refused with the reason)."""
        self.serving.draining = False
        return self.rl.rpc_continue_generation()

    def rpc_vllm_pause_state(self) -> dict[str, Any]:
        """Paused (or draining toward a pause), and the memory tags released."""
        s = self.serving
        return {"paused": s.paused or s.draining, "draining": s.draining,
                "released": sorted(self.rl.memory_saver.released)}

    # -- prefix cache --------------------------------------------------------------------------
    def rpc_reset_prefix_cache(self, reset_running_requests: bool = False,
                               reset_external: bool = False) -> dict[str, Any]:
        """vLLM's ``reset_prefix_cache``. ``reset_external``: the lower cache tiers (host
        memory, and storage as ``hicache_storage_flush`` says) are emptied with the device's
        by every flush, so it changes nothing more."""
        for name, value in (("reset_running_requests", reset_running_requests),
                            ("reset_external", reset_external)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be true or false, got {value!r}")
        s = self.serving
        if reset_running_requests:
            for req in sorted(s.active_reqs(), key=lambda r: r.arrival, reverse=True):
                s.retract(req)
        if s.active_reqs():
            return {"success": False, "num_holding_kv": len(s.active_reqs())}
        self.kv.flush()
        self.weights.flush_pending = False
        return {"success": True}
