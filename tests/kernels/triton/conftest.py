"""Kernel test setup: run Triton in its CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here,
before any test module imports ``rollout_engine_kernels.triton.*``. (A conftest higher up that
imports the kernels first would defeat this; the launchers then raise a ValueError naming the
device mismatch.)
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from rollout_engine_kernels.triton._utils import interpret_mode  # noqa: E402

RESERVED_SLOT = 0  # never allocated; its K/V are poisoned so a stray read shows up


@dataclass
class KVPool:
    """A filled KV pool plus the request table pointing into it."""

    k_buffer: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [max_num_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token (shuffled)


def build_kv_pool(
    kv_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    layout: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    page_size: int = 16,
    seed: int = 0,
) -> KVPool:
    """Random KV pool where request b owns ``kv_lens[b]`` token slots laid out as ``layout``.

    layout "contiguous": each request's slots are consecutive;
           "permuted":   slots are a random permutation (page_size 1 after churn);
           "paged":      pages of ``page_size`` consecutive slots, pages in shuffled order.
    """
    gen = torch.Generator().manual_seed(seed)
    if layout == "paged":
        num_pages = [-(-n // page_size) for n in kv_lens]
        order = torch.randperm(sum(num_pages) + 2, generator=gen)
        num_slots = 1 + (sum(num_pages) + 2) * page_size
        slot_lists, used = [], 0
        for n, pages in zip(kv_lens, num_pages, strict=True):
            starts = 1 + order[used : used + pages] * page_size
            used += pages
            slots = (starts[:, None] + torch.arange(page_size)[None, :]).flatten()
            slot_lists.append(slots[:n])
    elif layout in ("contiguous", "permuted"):
        num_slots = 1 + sum(kv_lens) + 7
        free = torch.arange(1, num_slots)
        if layout == "permuted":
            free = free[torch.randperm(num_slots - 1, generator=gen)]
        bounds = torch.tensor([0, *kv_lens]).cumsum(0).tolist()
        slot_lists = [free[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    else:
        raise ValueError(f"unknown layout {layout!r}")

    max_num_reqs = len(kv_lens) + 3
    req_to_token = torch.zeros(max_num_reqs, max(kv_lens, default=0) + 5, dtype=torch.int32)
    rows = torch.randperm(max_num_reqs, generator=gen)[: len(kv_lens)]
    for row, slots in zip(rows.tolist(), slot_lists, strict=True):
        req_to_token[row, : len(slots)] = slots.to(torch.int32)

    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen)
    v_buffer = torch.randn(shape, generator=gen)
    k_buffer[RESERVED_SLOT] = 30.0
    v_buffer[RESERVED_SLOT] = -30.0
    return KVPool(
        k_buffer=k_buffer.to(device=device, dtype=dtype),
        v_buffer=v_buffer.to(device=device, dtype=dtype),
        req_to_token=req_to_token.to(device),
        req_pool_indices=rows.to(device),
    )


@pytest.fixture
def kv_pool_builder():
    """The :func:`build_kv_pool` factory (fixtures are how tests share conftest helpers)."""
    return build_kv_pool


@pytest.fixture
def device() -> str:
    """Where kernel inputs live: CPU under the interpreter, CUDA otherwise."""
    return "cpu" if interpret_mode() else "cuda"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` kernel tests when CUDA is missing or interpreting."""
    if torch.cuda.is_available() and not interpret_mode():
        return
    skip = pytest.mark.skip(reason="needs CUDA with compiled (non-interpreted) Triton")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in item.path.parents:
            item.add_marker(skip)
