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

So the buffers that live long ask for huge pages themselves, before they are first written:
``empty`` / ``zeros`` madvise (MADV_HUGEPAGE) the 2 MB-aligned part of a new CPU tensor's
memory, and `advise` does it for one already made (parameters after ``to_empty``). Where the
OS has no madvise (not Linux) or ``ROLLOUT_ENGINE_HUGE_PAGES=0``, they are plain tensors.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Optional

import torch

HUGE_PAGES_ENV = "ROLLOUT_ENGINE_HUGE_PAGES"
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Optional[Callable[[int, int, int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages on the whole 2 MB pages inside ``t``'s memory (a CPU tensor, best
    before it is first written: pages already there stay small until the kernel merges them).
    Whether the request was made."""
    madvise = _madvise()
    if (madvise is None or not t.is_cpu or os.environ.get(HUGE_PAGES_ENV, "1") == "0"
            or t.numel() == 0):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` whose memory asks for huge pages on CPU (see `advise`)."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    advise(t)
    return t


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` whose memory asks for huge pages on CPU (see `advise`)."""
    return empty(shape, dtype, device).zero_()
