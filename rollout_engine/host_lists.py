"""Flat Python lists of numbers into CPU tensors, fast: the scheduler builds ~16 a step (slot
indices, positions, lengths, sampling parameters), a few hundred numbers each."""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["list_tensor"]

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def list_tensor(values: Sequence[float], dtype: torch.dtype = torch.int64,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a flat list of numbers (ints
    for the integer dtypes): ``array`` converts them in C and the tensor views its buffer
    (keeping it alive), ~7 us for 256 numbers where ``torch.tensor`` takes ~23. Other dtypes,
    empty lists and nested ones go to ``torch.tensor``."""
    code = _TYPECODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype, device=device)
    try:
        out = torch.frombuffer(array.array(code, values), dtype=dtype)
    except TypeError:   # not a flat list of numbers of that kind: torch's rules apply
        return torch.tensor(values, dtype=dtype, device=device)
    return out if device is None or torch.device(device).type == "cpu" else out.to(device)
