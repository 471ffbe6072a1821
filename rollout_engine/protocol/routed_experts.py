"""A finished request's routing record as it crosses to the frontend, and SGLang's wire form.

The scheduler sends the compact record (one narrow integer per MoE layer and expert slot); the
frontend widens it to what SGLang returns in ``meta_info["routed_experts"]``: base64 of a
C-order little-endian int32 array ``[rows, num_hidden_layers, top_k]``, row ``i`` the experts
of token ``routed_experts_start_len + i``, and -1 in every layer without experts (a dense
layer of a model whose MoE layers are ``moe_layers``). Clients decode it as slime does::

    np.frombuffer(base64.b64decode(s), dtype=np.int32).reshape(rows, num_layers, top_k)
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["RoutedExperts"]


@dataclass
class RoutedExperts:
    """Expert ids of ``rows`` consecutive tokens: ``data`` holds ``[rows, len(moe_layers),
    top_k]`` values of ``dtype`` (a numpy dtype name: uint8, int16 or int32), C order."""

    data: bytes
    dtype: str
    rows: int
    moe_layers: tuple[int, ...]
    num_layers: int
    top_k: int
    _b64: Optional[str] = field(default=None, repr=False, compare=False)

    def to_int32(self) -> np.ndarray:
        """``[rows, num_layers, top_k]`` int32, -1 in the layers without experts."""
        compact = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(
            self.rows, len(self.moe_layers), self.top_k)
        out = np.full((self.rows, self.num_layers, self.top_k), -1, dtype="<i4")
        out[:, list(self.moe_layers)] = compact
        return out

    def base64(self) -> str:
        """SGLang's ``meta_info["routed_experts"]`` (ASCII); made once per record."""
        if self._b64 is None:
            self._b64 = base64.b64encode(self.to_int32().tobytes()).decode("ascii")
        return self._b64
