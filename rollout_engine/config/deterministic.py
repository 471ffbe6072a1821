"""What ``enable_deterministic_inference`` needs of an ``EngineConfig``: batch invariance is
built from the CPU float32 kernels (``models/batch_invariant.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def check_deterministic(c: Any, bad: Callable[..., None]) -> None:
    """Call ``bad(flag, why)`` for each setting the mode cannot be honoured with."""
    if not c.enable_deterministic_inference:
        return
    flag = "enable_deterministic_inference"
    if c.resolved_device().type != "cpu" or c.resolved_dtype() != torch.float32:
        bad(flag, f"needs float32 on CPU (got dtype {c.dtype!r}, device {c.device!r}): its "
            "products and attention are the CPU float32 kernels")
    if c.resolved_attention_backend() != "torch_native":
        bad(flag, f"needs attention_backend torch_native, got {c.attention_backend!r}")
    if c.tp_size > 1:
        bad(flag, "is not supported with tp_size > 1 yet")
    if c.speculative_algorithm is not None and c.speculative_algorithm.upper() != "NGRAM":
        bad(flag, f"combines with speculative_algorithm NGRAM only, got "
            f"{c.speculative_algorithm!r}")
