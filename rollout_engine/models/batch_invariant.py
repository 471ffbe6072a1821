"""Batch-invariant forwards (``enable_deterministic_inference``): a token's hidden states,
logits and logprob are the same bits whatever else is in its batch, however its prompt was
chunked, whether its prefix came from the radix cache, and with 1 or 2 threads.

Every reduction on the path is fixed per row, by construction:

- products (every projection, the LM head): the rows go through one oneDNN primitive of a
  fixed shape, ``TILE`` rows on the weight's packed copy (a short last tile padded with zero
  rows), so every row of every batch is computed by the same code with the same blocking,
  whatever its neighbours; the fast path's primitive follows the batch's row count, and its
  blocking with it. Each weight shape is probed once (``tiles_agree``: a row at several tile
  positions, among other rows, with 1 and 2 threads, bit for bit); where the probe fails, or
  oneDNN is off, the small-GEMM kernel (``kernels/cpu/small_gemm``) takes the shape: each
  output one sequential sum over k, threads split the outputs, invariant by construction.
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


@functools.cache
def tiles_agree(n: int, k: int, bias: bool) -> bool:
    """Whether oneDNN's ``TILE``-row product of an ``[n, k]`` packed weight gives a row the
    same bits at any position among any other rows, with 1 and 2 threads (probed once)."""
    if not weight_packs.packing_ok():
        return False
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, weight_packs.PACK_ROWS)
    row = torch.randn(k, generator=gen)
    want = None
    threads = torch.get_num_threads()
    try:
        for t, pos in ((threads, 0), (threads, 37), (threads, TILE - 1), (1, 5)):
            torch.set_num_threads(t)
            x = torch.randn(TILE, k, generator=gen)
            x[pos] = row
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[pos]
            if want is None:
                want = got
            elif not torch.equal(got, want):
                return False
    finally:
        torch.set_num_threads(threads)
    return True


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
    packed = weight_packs.packed(weight) if tiles_agree(n, k, bias is not None) else None
    if packed is None:
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        out = kernel()(flat, w, bias)
        return out.view(*x.shape[:-1], n)
    out = torch.empty(rows, n, dtype=torch.float32)
    pointwise = torch.ops.mkldnn._linear_pointwise
    for r0 in range(0, rows, TILE):
        r1 = min(rows, r0 + TILE)
        tile = flat[r0:r1]
        if r1 - r0 < TILE:
            staged = flat.new_zeros(TILE, k)
            staged[:r1 - r0] = tile
            tile = staged
        out[r0:r1] = pointwise(tile, packed, bias, "none", [], "")[:r1 - r0]
    return out.view(*x.shape[:-1], n)
