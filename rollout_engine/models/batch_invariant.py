"""Batch-invariant forwards (``enable_deterministic_inference``): a token's hidden states,
logits and logprob are the same bits whatever else is in its batch, however its prompt was
chunked, whether its prefix came from the radix cache, and with 1 or 2 threads.

Every reduction on the path is fixed per row, by construction:

- products (every projection, the LM head): the small-GEMM kernel
  (``kernels/cpu/small_gemm``) at every row count. Each output is one sequential sum over k,
  threads split the outputs (never k), so a row's result does not depend on how many rows
  run with it. (The fast path picks oneDNN or the kernel by row count, and oneDNN's blocking
  follows the row count.)
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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from rollout_engine_kernels.cpu.small_gemm import SmallGemm, load_small_gemm

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


def product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors, each output row one sequential
    sum over k whatever the row count."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = kernel()(flat, w, bias)
    return out.view(*x.shape[:-1], out.shape[-1])
