"""`start_call`'s answers (`transports.base.Answer`): a call sent through an engine's
``send_call`` is waited for in the waiting thread when it is waited for alone (no thread per
call: a refit in small buckets would pay one on the cores the engine copies with), in a
thread of its own otherwise; either way exactly once, failures and refusals delivered."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from trainer_bridge.transports.base import (
    Answer,
    WeightSyncError,
    call_all,
    start_call,
    waited,
)


class SendingEngine:
    """Answers `send_call` with a wait that records the thread it ran in (and may block)."""

    def __init__(self, answer: Any = (True, "ok"), gate: threading.Event | None = None) -> None:
        self.answer, self.gate = answer, gate
        self.waits: list[str] = []

    def send_call(self, method: str, *args: Any, **kwargs: Any):
        def wait() -> Any:
            self.waits.append(threading.current_thread().name)
            if self.gate is not None:
                assert self.gate.wait(30)
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer
        return wait


def test_a_lone_answer_is_waited_for_in_the_callers_thread():
    engine = SendingEngine()
    future = start_call(engine, "update_weights_from_tensor", [])
    assert isinstance(future, Answer) and not future.done()
    before = threading.active_count()
    assert call_all([future]) == [(True, "ok")]
    assert engine.waits == [threading.current_thread().name]
    assert threading.active_count() == before


def test_several_answers_or_a_timeout_get_threads_and_run_once():
    gate = threading.Event()
    engines = [SendingEngine(gate=gate), SendingEngine(gate=gate)]
    futures = [start_call(e, "update_weights_from_tensor", []) for e in engines]
    waited(futures)          # threads wait now, while both are blocked
    gate.set()
    assert call_all(futures) == [(True, "ok")] * 2
    for e in engines:
        assert e.waits == ["answer"]   # once each, in a thread of its own
    lone = start_call(SendingEngine(), "update_weights_from_tensor", [])
    assert call_all([lone], timeout=30) == [(True, "ok")]
    lone.wait_here()         # already settled: nothing runs again
    assert lone.result() == (True, "ok")


def test_a_timeout_still_bounds_a_lone_answer():
    gate = threading.Event()
    future = start_call(SendingEngine(gate=gate), "update_weights_from_tensor", [])
    with pytest.raises(TimeoutError):
        call_all([future], timeout=0.05)
    gate.set()
    assert future.result(30) == (True, "ok")


def test_refusals_and_failures_reach_the_waiter():
    refused = start_call(SendingEngine((False, "bad shape")), "update_weights_from_tensor", [])
    with pytest.raises(WeightSyncError, match="bad shape"):
        call_all([refused])
    failed = start_call(SendingEngine(ConnectionError("gone")), "update_weights_from_tensor", [])
    with pytest.raises(ConnectionError, match="gone"):
        call_all([failed])
