"""Shared fixtures: tiny models built locally (once per machine) and engines that prove the
KV invariant when a test ends."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run on CPU in the interpreter; the flag must precede any kernel import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in the test process: tiny matmuls gain nothing from a second thread, and
# spinning OpenMP workers steal the core a process-mode scheduler needs.
torch.set_num_threads(1)

ARCHS = ("qwen2", "qwen3", "llama")


@pytest.fixture(scope="session")
def tiny_paths() -> dict[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    paths = {arch: str(tiny_model_path(arch)) for arch in ARCHS}
    paths["llama3_scaled"] = str(tiny_model_path("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}))
    return paths


@pytest.fixture(scope="session")
def qwen2_path(tiny_paths: dict[str, str]) -> str:
    return tiny_paths["qwen2"]


@pytest.fixture
def make_engine() -> Iterator[Any]:
    """``make_engine(path, **flags)``: an Engine (thread scheduler unless told otherwise) whose
    integrity is checked and which is shut down when the test ends."""
    from rollout_engine import Engine

    engines: list[Any] = []

    def make(model_path: str, **flags: Any) -> Any:
        flags.setdefault("scheduler_mode", "thread")
        flags.setdefault("dtype", "float32")
        flags.setdefault("device", "cpu")
        eng = Engine(model_path=model_path, **flags)
        engines.append(eng)
        return eng

    yield make
    try:
        for eng in engines:
            if eng.tm.dead is None:
                eng.check_integrity()
    finally:
        for eng in engines:
            eng.shutdown()
