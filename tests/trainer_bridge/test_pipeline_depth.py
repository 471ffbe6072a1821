"""Bucketed syncs keep two calls outstanding only with engines that take calls in the order
sent (``send_call``); any other engine gets one call at a time, so a thread per call can never
deliver bucket k+1 before bucket k."""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainer_bridge.transports.base import pipeline_depth
from trainer_bridge.transports.tensor import TensorTransport


class FakeEngine:
    """Answers update_weights_from_tensor after `release` lets it; counts calls in progress."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.versions: list[str] = []

    def update_weights_from_tensor(self, payload: Any, **kwargs: Any) -> tuple[bool, str]:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            # hold the call a moment so an overlapping one would be seen
            threading.Event().wait(0.02)
            self.versions.append(kwargs["weight_version"])
            return True, "ok"
        finally:
            with self.lock:
                self.active -= 1


class OrderedEngine(FakeEngine):
    def send_call(self, method: str, *args: Any, **kwargs: Any):
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=getattr(self, method)(*args, **kwargs)))
        t.start()
        return lambda: (t.join(), box["r"])[1]


def _tensors() -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((1024,), float(i))) for i in range(8)]


def test_depth_needs_every_engine_to_keep_order():
    assert pipeline_depth([OrderedEngine(), OrderedEngine()], 2) == 2
    assert pipeline_depth([OrderedEngine(), FakeEngine()], 2) == 1
    assert pipeline_depth([FakeEngine()], 2) == 1


def test_an_engine_without_send_call_gets_one_call_at_a_time():
    engine = FakeEngine()
    TensorTransport(bucket_bytes=4096, pack=False).push([engine], _tensors(), "v")
    assert engine.peak == 1
    assert len(engine.versions) == 8 and engine.versions[-1] == "v"
