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


def _mapping(t: torch.Tensor) -> tuple[str, list[str]]:
    """(header line, VmFlags) of the mapping holding ``t``'s middle byte."""
    addr = t.data_ptr() + t.numel() * t.element_size() // 2
    header = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                header = line if lo <= addr < hi else None
            elif header is not None and line.startswith("VmFlags:"):
                return header, line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _advised(t: torch.Tensor) -> bool:
    """Whether ``t`` is in a private anonymous mapping that asked for huge pages (the hg
    flag; shared anonymous memory is shmem, named /dev/zero, with its own huge-page rule)."""
    header, flags = _mapping(t)
    private_anonymous = len(header.split()) == 5 and "sh" not in flags
    return "hg" in flags and private_anonymous


def test_a_large_buffer_asks_in_a_mapping_of_its_own():
    cpu = torch.device("cpu")
    big = huge_pages.zeros((4 << 20,), torch.float32, cpu)        # 16 MB
    assert float(big.abs().max()) == 0.0 and big.is_contiguous()
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _advised(big)
    grid = huge_pages.empty((1024, 3000), torch.bfloat16, cpu)
    assert grid.shape == (1024, 3000) and grid.dtype == torch.bfloat16 and _advised(grid)
    grid.fill_(2.0)
    assert float(grid.float().sum()) == 2.0 * 1024 * 3000
    # what torch allocates after it (and after it is gone) is not advised
    del big
    for _ in range(3):
        assert not _advised(torch.zeros(4 << 20))


def test_small_off_or_disabled_buffers_are_plain(monkeypatch):
    cpu = torch.device("cpu")
    small = huge_pages.zeros((1000,), torch.float32, cpu)
    assert float(small.abs().max()) == 0.0 and not _advised(small)
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    t = huge_pages.zeros((4 << 20,), torch.float32, cpu)
    assert float(t.abs().max()) == 0.0 and not _advised(t)


def test_the_kv_pool_and_the_parameters_ask(qwen2_path):
    pool = KVPool(70000, 2, 2, 64, torch.float32, torch.device("cpu"))    # 36 MB a buffer
    assert all(_advised(b) for b in (*pool.k_buffers, *pool.v_buffers))
    assert all(float(b.abs().max()) == 0.0 for b in pool.k_buffers)
    from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

    runner = ModelRunner(EngineConfig(model_path=str(tiny_model_path("qwen2", **PRESET_55M)),
                                      device="cpu", dtype="float32", max_total_tokens=64))
    params = list(runner.model.parameters())
    big = [p for p in params if p.numel() * 4 >= huge_pages.HUGE_PAGE]
    assert big and all(_advised(p) for p in big)
    assert not any(_advised(p) for p in params if p.numel() * 4 < huge_pages.HUGE_PAGE)
