"""Transparent huge pages for the engine's long-lived CPU buffers, and for nothing else.

The KV pool is read a slot at a time all over its layers' buffers, and a refit writes every
parameter: with 4 KB pages both take a TLB miss every few rows (the CPU decode kernel at batch
128 read one layer's KV in 0.70 ms instead of 0.48 on huge pages; a refit's copy was ~25%
slower). torch's allocator can ask for huge pages itself (``THP_MEM_ALLOC_ENABLE=1``), but
for every allocation of 2 MB or more, which includes a forward's activations: each is a fresh
region the kernel must fill with 2 MB pages, compacting memory to find them when the host
is fragmented (``defrag=madvise``), on the 2-core development VM 2.5 ms for a [256, 32000]
logits tensor and 9.6 ms for a prefill's [1024, 2816] gate_up output against 0.6 / 0.1 ms
on 4 KB pages, which halved the prefill's gate_up product (7 -> 14 ms a layer in the engine).

So the buffers that live long get memory of their own: `empty` / `zeros` map a fresh
anonymous region (``mmap``, zero-filled by the kernel), ask for huge pages on it
(MADV_HUGEPAGE) before anything is written, and return a tensor over its 2 MB-aligned start
(the tensor keeps the mapping alive; it is unmapped with the last tensor on it). Their own
mapping, not the allocator's heap: advice given on heap memory would stay on it after the
buffer is freed and reach the activations allocated there later. Below one huge page, off
CPU, where the OS has no MADV_HUGEPAGE, or with ``ROLLOUT_ENGINE_HUGE_PAGES=0`` they are
plain ``torch.empty`` / ``torch.zeros``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import torch

HUGE_PAGES_ENV = "ROLLOUT_ENGINE_HUGE_PAGES"
HUGE_PAGE = 2 << 20


def _mapped(shape: Sequence[int], dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor | None:
    """A tensor over a fresh huge-page-advised mapping, or None where that does not apply."""
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if (torch.device(device).type != "cpu" or nbytes < HUGE_PAGE
            or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get(HUGE_PAGES_ENV, "1") == "0"):
        return None
    # private: a shared anonymous mapping is shmem, whose huge pages the host's shmem_enabled
    # governs (usually never)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` on CPU memory of its own that asks for huge pages (module docstring)."""
    t = _mapped(shape, dtype, device)
    return torch.empty(tuple(shape), dtype=dtype, device=device) if t is None else t


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` likewise. The zeros are written, although a fresh mapping reads as
    zeros already: so its pages are there from the start (the KV pool's memory is held, and
    given back by a sleep, as ``kv_pool_bytes`` says), not faulted in by the steps that
    first reach them."""
    t = _mapped(shape, dtype, device)
    return torch.zeros(tuple(shape), dtype=dtype, device=device) if t is None else t.zero_()

