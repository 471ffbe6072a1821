"""The frontend's end of control calls: send with a deadline, wait, give up, hear late answers.

    start(method)  -> ControlReq(call_id, deadline) sent; a waiter returned
    waiter()       -> the ControlResult, or a 504 result once the deadline passed
    on_result(msg) <- the receiver thread: hands an answer to its waiter, or, when the waiter
                      gave up, logs and counts it (cancelled before it started, or ran late)
    fail_all(msg)  <- the scheduler died: every waiter gets a 503 result

Every answer that reports the scheduler's sleep / stale-weights state (`released`,
`weights_stale`, a refit's `weight_version`) updates this frontend's mirror of it, the newest
call's answer winning, so generation can be refused without asking the scheduler. Likewise
the LoRA adapters loaded (`loaded_adapters`): a request naming another is refused here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from rollout_engine.protocol.messages import ControlReq, ControlResult

logger = logging.getLogger(__name__)

__all__ = ["ControlClient"]


class ControlClient:
    """Control calls in flight over `send` (the channel to the scheduler), and the sleep /
    stale-weights state their answers reported. Thread-safe: callers start and wait on any
    thread; the receiver thread alone calls `on_result` and `fail_all`."""

    def __init__(self, send: Callable[[Any], None], default_timeout: float) -> None:
        self.send = send
        self.default_timeout = default_timeout
        self.lock = threading.Lock()
        self.calls: dict[int, tuple[threading.Event, list[ControlResult]]] = {}
        self.timed_out_calls: dict[int, str] = {}   # call id -> method, until its late answer
        self.stats = {"timed_out": 0, "ran_after_timeout": 0, "cancelled_after_timeout": 0}
        self.call_ids = itertools.count(1)
        self.mirrored_call = 0   # the newest call whose answer set released / stale
        self.released: set[str] = set()     # memory tags released (mirrors the scheduler)
        self.weights_stale = False
        self.stale_reason: Optional[str] = None
        self.lora_call = 0        # the newest call whose answer set lora_adapters
        self.lora_adapters: dict[str, Any] = {}   # name -> SGLang's LoRARef fields

    def start(self, method: str, timeout: Optional[float] = None, **kwargs: Any
              ) -> Callable[[], ControlResult]:
        """Send the call now (calls sent one after another reach the scheduler in that order)
        and return a function that waits for its result, at most `timeout` s (default
        `default_timeout`). The call carries that deadline: if the scheduler has not started
        it by then it is cancelled; if it had, it runs to the end, and its late answer is
        logged and counted in `stats`."""
        wait_s = timeout if timeout is not None else self.default_timeout
        call_id = next(self.call_ids)
        event = threading.Event()
        box: list[ControlResult] = []
        with self.lock:
            self.calls[call_id] = (event, box)
        self.send(ControlReq(method, kwargs, call_id, deadline=time.time() + wait_s))

        def wait() -> ControlResult:
            if not event.wait(wait_s):
                with self.lock:
                    gave_up = self.calls.pop(call_id, None) is not None
                    if gave_up:
                        self.timed_out_calls[call_id] = method
                        self.stats["timed_out"] += 1
                if gave_up:
                    return ControlResult(call_id, False, status=504, message=(
                        f"{method} timed out after {wait_s:g} s and may have run: one the "
                        "scheduler had started runs to completion, one it had not is "
                        "cancelled; check get_weight_version / get_server_info before "
                        "retrying"))
                event.wait()   # the answer arrived as we gave up: the receiver hands it over
            result = box[0]
            self._mirror(method, result)
            return result

        return wait

    def on_result(self, msg: ControlResult) -> None:
        """An answer from the scheduler: to its waiter, or counted as a late one."""
        with self.lock:
            entry = self.calls.pop(msg.call_id, None)
        if entry is not None:
            entry[1].append(msg)
            entry[0].set()
        else:
            self._on_late_result(msg)

    def fail_all(self, message: str) -> None:
        """The scheduler died: every call in flight answers 503 with `message`."""
        with self.lock:
            calls = list(self.calls.values())
            self.calls.clear()
        for event, box in calls:
            box.append(ControlResult(0, False, message=message, status=503))
            event.set()

    def _mirror(self, method: str, result: ControlResult) -> None:
        """Keep the frontend's view of sleep / stale weights in step with the scheduler's: the
        view of the newest call that reported one (calls in flight together, such as a refit's
        pipelined buckets, run in order but their answers may be read in any order)."""
        if not result.success or not isinstance(result.result, dict):
            return
        if "loaded_adapters" in result.result:
            with self.lock:
                if result.call_id >= self.lora_call:
                    self.lora_call = result.call_id
                    self.lora_adapters = dict(result.result["loaded_adapters"])
        if not ({"released", "weights_stale"} & result.result.keys()
                or ("weight_version" in result.result and method.startswith("update_weights"))):
            return
        with self.lock:
            if result.call_id < self.mirrored_call:
                return
            self.mirrored_call = result.call_id
        if "released" in result.result:
            self.released = set(result.result["released"])
        if "weights_stale" in result.result:
            self.weights_stale = bool(result.result["weights_stale"])
            self.stale_reason = result.result.get("stale_reason")
        elif "weight_version" in result.result and method.startswith("update_weights"):
            self.weights_stale = False

    def _on_late_result(self, msg: ControlResult) -> None:
        """The answer of a call whose caller timed out: it either never ran or ran late."""
        with self.lock:
            method = self.timed_out_calls.pop(msg.call_id, None)
            if method is not None:
                key = "cancelled_after_timeout" if msg.cancelled else "ran_after_timeout"
                self.stats[key] += 1
        if method is None:
            return
        if msg.cancelled:
            logger.info("control call %s (id %d) timed out before it started: cancelled",
                        method, msg.call_id)
            return
        logger.warning("control call %s (id %d) ran after its caller timed out (success=%s): %s",
                       method, msg.call_id, msg.success, msg.message or msg.result)
        self._mirror(method, msg)
