"""Colocated RL: the engine sleeps while the trainer steps, then wakes and refits.

    with engine_sleeping(engine, syncer, model, version="12") as times:
        train_step(model)          # the engine's weights / KV memory is free for the trainer
    # here: memory resumed, model's weights loaded, version "12"; times.refit_seconds, ...
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

from trainer_bridge.weight_syncer import SyncReport, WeightSyncer

__all__ = ["SleepReport", "engine_sleeping"]


@dataclass
class SleepReport:
    """Filled in as the context runs: seconds spent releasing, resuming and refitting, the
    bytes the engines reported freed, and the refit's `SyncReport` (None without a refit)."""

    release_seconds: float = 0.0
    resume_seconds: float = 0.0
    refit_seconds: float = 0.0
    bytes_freed: int = 0
    sync: Optional[SyncReport] = None


@contextmanager
def engine_sleeping(engine_or_client: Union[Any, Sequence[Any]],
                    syncer: Optional[WeightSyncer] = None, model: Any = None,
                    tags: Optional[list[str]] = None, version: Optional[str] = None
                    ) -> Iterator[SleepReport]:
    """Release the engines' memory (`tags`: weights, kv_cache, cuda_graph; None = all) on
    enter; resume it on exit, then, with a `syncer` and a `model`, `syncer.sync(model,
    version)`.

    The engines must be idle on enter (finish or `pause_generation` first): a busy engine
    refuses to sleep and the error is raised before the body runs. They are resumed even if
    the body raises (the refit is skipped then). After releasing "weights" without a CPU
    backup an engine refuses to generate until it is refitted, so pass `syncer` and `model`.
    """
    engines = list(engine_or_client) if isinstance(engine_or_client, (list, tuple)) \
        else [engine_or_client]
    if (syncer is None) != (model is None):
        raise ValueError("syncer and model: give both (refit on wake) or neither")
    report = SleepReport()
    start = time.perf_counter()
    released = []
    try:
        for e in engines:
            answer = e.release_memory_occupation(tags)
            released.append(e)
            if isinstance(answer, dict):
                report.bytes_freed += int(answer.get("bytes_freed", 0))
    except BaseException:
        for e in released:
            e.resume_memory_occupation(tags)
        raise
    report.release_seconds = time.perf_counter() - start
    body_ok = False
    try:
        yield report
        body_ok = True
    finally:
        start = time.perf_counter()
        for e in engines:
            e.resume_memory_occupation(tags)
        report.resume_seconds = time.perf_counter() - start
    if body_ok and syncer is not None:
        start = time.perf_counter()
        report.sync = syncer.sync(model, version)
        report.refit_seconds = time.perf_counter() - start
