"""memory/huge_pages.py: the long-lived CPU buffers (KV pool, parameters, refit spares, weights
woken from sleep) ask for transparent huge pages on their own memory, and nothing else does.

The request is what is checked (the kernel's ``hg`` flag on the mapping, /proc/self/smaps),
not whether huge pages were granted: that depends on the host's free memory.
"""

from __future__ import annotations

import sys

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.memory import huge_pages
from rollout_engine.memory.kv_pool import KVPool
from rollout_engine.model_runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="madvise and /proc/self/smaps are Linux's")


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s middle byte has the MADV_HUGEPAGE flag."""
    addr = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_large_buffer_asks_and_a_plain_one_does_not():
    big = huge_pages.zeros((4 << 20,), torch.float32, torch.device("cpu"))   # 16 MB
    assert big.abs().sum().item() == 0.0
    assert _advised(big)
    plain = torch.zeros(4 << 20)
    assert not _advised(plain)


def test_what_cannot_hold_a_whole_huge_page_is_left_alone(monkeypatch):
    assert not huge_pages.advise(torch.empty(1000))
    assert not huge_pages.advise(torch.empty(0))
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    t = huge_pages.empty((4 << 20,), torch.float32, torch.device("cpu"))
    assert not huge_pages.advise(t)
    assert not _advised(t)


def test_the_kv_pool_and_the_parameters_ask(qwen2_path):
    pool = KVPool(70000, 2, 2, 64, torch.float32, torch.device("cpu"))    # 36 MB a buffer
    assert all(_advised(b) for b in (*pool.k_buffers, *pool.v_buffers))
    assert all(float(b.abs().max()) == 0.0 for b in pool.k_buffers)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    runner = ModelRunner(EngineConfig(model_path=str(tiny_model_path("qwen2", **PRESET_55M)),
                                      device="cpu", dtype="float32", max_total_tokens=64))
    big = [p for p in runner.model.parameters() if p.numel() * 4 >= 4 * huge_pages.HUGE_PAGE]
    assert big and all(_advised(p) for p in big)
