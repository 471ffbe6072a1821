"""TimedEngine (what RolloutFleet's syncer calls): update calls in flight are counted from
send to answer, on both paths (an engine with send_call, a plain one called in the waiting
thread), the answer time is kept, and other attributes pass through untouched."""

from __future__ import annotations

import threading
from typing import Any

from trainer_bridge.timed_engine import TimedEngine


class Sending:
    """An engine with send_call whose answers arrive when `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[str] = []

    def send_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(kwargs["weight_version"])

        def answer() -> tuple[bool, str]:
            self.release.wait()
            return True, "ok"
        return answer

    def get_weight_version(self) -> str:
        return "w1"


class Plain:
    def update_weights_from_disk(self, path: str, weight_version: str) -> tuple[bool, str]:
        return True, f"{path} {weight_version}"


def test_calls_in_flight_are_counted_until_answered():
    engine = Sending()
    timed = TimedEngine(engine)
    first = timed.send_call("update_weights_from_distributed", weight_version="v.partial0")
    second = timed.send_call("update_weights_from_distributed", weight_version="v")
    assert engine.sent == ["v.partial0", "v"] and timed.pending == 2
    assert not timed.wait_answered(0.0) and timed.answered is None
    engine.release.set()
    assert first() == (True, "ok") and second() == (True, "ok")
    assert timed.pending == 0 and timed.wait_answered(0.0)
    assert timed.seconds_since(0.0, default=-1.0) == timed.answered
    assert timed.get_weight_version() == "w1"      # not an update: passed through


def test_an_engine_without_send_call_is_called_when_awaited():
    timed = TimedEngine(Plain())
    answer = timed.send_call("update_weights_from_disk", "/ckpt", weight_version="v")
    assert timed.pending == 0 and timed.answered is None   # nothing sent yet
    assert answer() == (True, "/ckpt v")
    assert timed.pending == 0 and timed.answered is not None
