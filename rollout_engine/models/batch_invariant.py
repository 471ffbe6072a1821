"""Batch-invariant forwards (``enable_deterministic_inference``): a token's hidden states,
logits and logprob are the same bits whatever else is in its batch, however its prompt was
chunked, whether its prefix came from the radix cache, and with 1 or 2 threads.

Every reduction on the path is fixed per row, by construction or, for oneDNN's products, by a
probe of this host's oneDNN:

- products (every projection, the LM head): oneDNN on the weight's packed copy where a
  one-time probe per weight shape (``row_mode``) shows a row's bits independent of its
  position, of the other rows and of the thread count: at any row count ("whole": one call),
  or at a fixed one ("tiles": ``TILE``-row calls, a short last tile padded with zero rows).
  Where neither holds, or oneDNN is off, the small-GEMM kernel (``kernels/cpu/small_gemm``):
  each output one sequential sum over k, threads split the outputs, invariant by
  construction. (The fast path mixes the kernel and oneDNN by row count, and oneDNN may pick
  its blocking by row count: a row's bits then follow its batch.)
- attention: every query token, of a decode or of a prefill, is one row of the paged
  kernel (``kernels/cpu/paged_decode``) over its own slots ``0 .. position``, blocks of 32
  keys in order, no shared-prefix cascade (its merge would depend on the neighbours); see
  ``TorchNativeBackend(batch_invariant=True)``.
- norms, RoPE, activation: the fused CPU ops, parallel over rows only.
- sampling: the one-pass sampler kernel per row, its logprob computed the same way for a
  row whatever its neighbours ask (``sampler.sample``).

The mode is per thread (``forwards(on)`` around a model's forward: the scheduler's thread
in thread mode, so engines side by side in one process keep their own setting).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from rollout_engine_kernels.cpu.small_gemm import SmallGemm, load_small_gemm

from rollout_engine.models import weight_packs

_state = threading.local()


def active() -> bool:
    """Whether this thread's forwards are batch-invariant now."""
    return getattr(_state, "on", False)


@contextmanager
def forwards(on: bool) -> Iterator[None]:
    """``with forwards(True): model(...)``: the products inside are batch-invariant."""
    before = active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def kernel() -> SmallGemm:
    """The small-GEMM kernel; RuntimeError where it cannot be built (the mode needs it)."""
    op = load_small_gemm()
    if op is None:
        raise RuntimeError("enable_deterministic_inference needs the CPU small-GEMM kernel, "
                           "which could not be built here (see the warning above)")
    return op


TILE = 64   # rows per oneDNN call: a decode batch of 64 runs as the fast path does
PROBE_COLUMNS = 8192   # the probe's weight keeps at most this many output rows (speed)


@functools.cache
def row_mode(n: int, k: int, bias: bool) -> str:
    """How an ``[n, k]`` weight's products run batch-invariantly here, probed once: a row is
    computed at several positions among other random rows, with 1 and with the current
    number of threads, and compared bit for bit.

    ``"whole"``: oneDNN on the packed weight gives a row the same bits at any row count
    (1-512 probed), so a product is one call, its rows padded to a multiple of ``TILE`` (a
    bounded number of primitive shapes); ``"tiles"``: the same only at a fixed row count, so
    ``TILE``-row calls; ``"kernel"``: neither (or oneDNN off): the small-GEMM kernel."""
    if not weight_packs.packing_ok():
        return "kernel"
    gen = torch.Generator().manual_seed(n * 31 + k)
    cols = min(n, PROBE_COLUMNS)
    w = torch.randn(cols, k, generator=gen) / k ** 0.5
    b = torch.randn(cols, generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, weight_packs.PACK_ROWS)
    row = torch.randn(k, generator=gen)
    threads = torch.get_num_threads()

    def same(cases: tuple[tuple[int, int, int], ...], want: torch.Tensor) -> bool:
        for t, rows, pos in cases:
            torch.set_num_threads(t)
            x = torch.randn(rows, k, generator=gen)
            x[pos] = row
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[pos]
            if not torch.equal(got, want):
                return False
        return True

    try:
        x = torch.randn(TILE, k, generator=gen)
        x[0] = row
        want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[0]
        if not same(((threads, TILE, 37), (threads, TILE, TILE - 1), (1, TILE, 5)), want):
            return "kernel"
        whole = ((threads, 1, 0), (threads, 128, 100), (threads, 320, 3), (1, 320, 200),
                 (threads, 512, 511))
        return "whole" if same(whole, want) else "tiles"
    finally:
        torch.set_num_threads(threads)


def product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors, each output row computed the
    same way whatever the row count (see the module docstring)."""
    rows = x.numel() // max(1, x.shape[-1])
    n, k = weight.shape
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n)
    flat = x.reshape(rows, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    mode = row_mode(n, k, bias is not None)
    packed = weight_packs.packed(weight) if mode != "kernel" else None
    if packed is None:
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        out = kernel()(flat, w, bias)
        return out.view(*x.shape[:-1], n)
    pointwise = torch.ops.mkldnn._linear_pointwise
    if mode == "whole":   # one call, rows padded to a multiple of TILE
        out = pointwise(_zero_padded(flat, -(-rows // TILE) * TILE), packed, bias, "none",
                        [], "")[:rows]
        return out.view(*x.shape[:-1], n)
    out = torch.empty(rows, n, dtype=torch.float32)
    for r0 in range(0, rows, TILE):
        r1 = min(rows, r0 + TILE)
        tile = _zero_padded(flat[r0:r1], TILE)
        out[r0:r1] = pointwise(tile, packed, bias, "none", [], "")[:r1 - r0]
    return out.view(*x.shape[:-1], n)


def _zero_padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` followed by zero rows up to ``count`` (``rows`` itself when it has them)."""
    if rows.shape[0] == count:
        return rows
    staged = rows.new_zeros(count, rows.shape[1])
    staged[:rows.shape[0]] = rows
    return staged
