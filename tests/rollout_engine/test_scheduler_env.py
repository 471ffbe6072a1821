"""The scheduler child's runtime settings: what it gets by default, and the caller's own win.

These are read once, when the child's libraries load, so they only take effect through the
child's environment: OpenMP waits that spin briefly (GOMP_SPINCOUNT; purely passive waits cost
a futex wake-up per parallel region, ~25% of an offline batch-64 rollout) and oneDNN's primitive
cache size; not transparent huge pages for torch's allocator (the long-lived buffers ask for
them themselves: memory/huge_pages.py).
"""

from __future__ import annotations

import pytest

from rollout_engine import Engine
from rollout_engine.testing.tiny_model import tiny_model_path

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}


def child_environ(monkeypatch: pytest.MonkeyPatch, **overrides: str) -> dict[str, str]:
    for key in DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    for key, value in overrides.items():
        monkeypatch.setenv(key, value)
    engine = Engine(model_path=str(tiny_model_path("qwen2")), dtype="float32", device="cpu",
                    num_threads=2, random_seed=0, max_total_tokens=1024)
    try:
        with open(f"/proc/{engine.tm.host.pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
        return {k.decode(): v.decode() for k, v in pairs}
    finally:
        engine.shutdown()


def test_the_scheduler_child_gets_short_spinning_openmp_waits_by_default(monkeypatch):
    env = child_environ(monkeypatch)
    assert {k: env.get(k) for k in DEFAULTS} == DEFAULTS


@pytest.mark.slow   # two scheduler processes started
def test_the_child_does_not_ask_torch_for_huge_pages_unless_told(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert "THP_MEM_ALLOC_ENABLE" not in child_environ(monkeypatch)
    assert child_environ(monkeypatch, THP_MEM_ALLOC_ENABLE="1")["THP_MEM_ALLOC_ENABLE"] == "1"


def test_the_callers_own_settings_reach_the_child_unchanged(monkeypatch):
    env = child_environ(monkeypatch, GOMP_SPINCOUNT="0", OMP_WAIT_POLICY="ACTIVE")
    assert (env["GOMP_SPINCOUNT"], env["OMP_WAIT_POLICY"]) == ("0", "ACTIVE")
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
