"""What a load or a refit of a quantized model is given, turned into what its parameters hold.

Every weight path (the first load, ``update_weights_from_tensor``, ``_from_distributed``,
``_from_disk``, vLLM's transfer) checks and copies ``(hf_name, tensor)`` pairs through
``weights/loader.py``, which passes them here first. For each weight of a quantized linear
(``names``):

    w8a8_int8   a float tensor (bf16 / fp16 / fp32 from a trainer or a plain checkpoint) is
                quantized here (`int8.quantize_weight_int8`) into the int8 weight and its
                ``<name>_scale``; an int8 tensor must come with its ``<name>_scale``
                (compressed-tensors' layout, or a trainer that quantized) and both go in as
                they are
    fp8         a float tensor is quantized into 128 x 128 e4m3 blocks and dequantized into
                the model's dtype (`fp8.quantize_blocks`); an e4m3 tensor must come with its
                ``<name>_scale_inv`` (SGLang / DeepSeek) or ``<name>_scale``
                (compressed-tensors) and is dequantized

A weight and its scale must arrive in the same update (one call; one bucket of a bucketed
refit). Every error is a ValueError naming the tensor, raised before anything is written.
`convert_specs` is the same decision on ``(name, shape, dtype)`` alone, for the paths that
check an update before its tensors exist (a broadcast's announcement, a checkpoint's headers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from rollout_engine.quantization import fp8, int8

__all__ = ["NoQuantizer", "WeightQuantizer", "create_quantizer"]

Spec = tuple[str, tuple[int, ...], torch.dtype]

_SCALE_SUFFIXES = {"w8a8_int8": ("_scale",), "fp8": ("_scale_inv", "_scale")}


class NoQuantizer:
    """A model without quantization: everything passes unchanged."""

    method: Optional[str] = None
    active = False

    def convert_specs(self, specs: Iterable[Spec]) -> list[Spec]:
        return list(specs)

    def convert(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return list(named)


class WeightQuantizer(NoQuantizer):
    """The conversion of ``method`` for the quantized linears' weight names ``names`` (module
    docstring). fp8's dequantized weights come out float32; the loader's copy casts them to
    the model's dtype (one rounding, as dequantizing straight into it)."""

    active = True

    def __init__(self, method: str, names: Iterable[str]) -> None:
        self.method = method
        self.names = frozenset(names)
        self.suffixes = _SCALE_SUFFIXES[method]

    def _scale_of(self, name: str, present: dict[str, Any]) -> Optional[str]:
        return next((name + s for s in self.suffixes if name + s in present), None)

    def _base_of(self, name: str) -> Optional[str]:
        for s in self.suffixes:
            if name.endswith(s) and name[:-len(s)] in self.names:
                return name[:-len(s)]
        return None

    def _kind(self, name: str, dtype: torch.dtype, present: dict[str, torch.dtype]) -> str:
        """'float' (quantize here) or 'quantized' (with its scale); raises ValueError."""
        stored = torch.int8 if self.method == "w8a8_int8" else fp8.FP8_DTYPE
        scale = self._scale_of(name, present)
        if dtype == stored:
            if scale is None:
                raise ValueError(
                    f"weight {name!r}: a {dtype} weight needs its scale "
                    f"({' or '.join(name + s for s in self.suffixes)}) in the same update")
            return "quantized"
        if dtype.is_floating_point and dtype.itemsize >= 2:
            if scale is not None:
                raise ValueError(
                    f"weight {name!r}: a {dtype} weight arrived with a scale ({scale!r}); send "
                    f"floating-point weights alone (the engine quantizes them for "
                    f"--quantization {self.method}) or {stored} weights with their scales")
            return "float"
        raise ValueError(f"weight {name!r}: dtype {dtype} cannot be loaded into a "
                         f"--quantization {self.method} layer (send a floating-point weight, "
                         f"or {stored} with its scale)")

    def _orphan(self, name: str, present: dict[str, torch.dtype]) -> None:
        base = self._base_of(name)
        if base is not None and base not in present:
            raise ValueError(f"weight {name!r}: a scale without its weight {base!r} in the "
                             "same update")

    def convert_specs(self, specs: Iterable[Spec]) -> list[Spec]:
        specs = list(specs)
        present = {name: dtype for name, _, dtype in specs}
        out: list[Spec] = []
        for name, shape, dtype in specs:
            if name in self.names:
                kind = self._kind(name, dtype, present)
                if self.method == "fp8":
                    out.append((name, shape, torch.float32))
                elif kind == "float":
                    out += [(name, shape, torch.int8),
                            (name + "_scale", (shape[0] if shape else 0, 1), torch.float32)]
                else:
                    out.append((name, shape, dtype))
            else:
                self._orphan(name, present)
                if self.method == "w8a8_int8" or self._base_of(name) is None:
                    out.append((name, shape, dtype))
        return out

    def convert(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        named = list(named)
        tensors = {name: t for name, t in named if isinstance(t, torch.Tensor)}
        present = {name: t.dtype for name, t in tensors.items()}
        out: list[tuple[str, Any]] = []
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                out.append((name, t))   # the loader names the bad entry
            elif name in self.names:
                kind = self._kind(name, t.dtype, present)
                if t.dim() != 2:
                    raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} is not a "
                                     "matrix")
                out += self._converted(name, t, kind, tensors)
            else:
                self._orphan(name, present)
                if self.method == "w8a8_int8" or self._base_of(name) is None:
                    out.append((name, t))
        return out

    def _converted(self, name: str, t: torch.Tensor, kind: str,
                   tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        if self.method == "w8a8_int8":
            if kind == "quantized":
                return [(name, t)]
            q, scale = int8.quantize_weight_int8(t)
            return [(name, q), (name + "_scale", scale)]
        if kind == "quantized":
            scale_name = self._scale_of(name, tensors)
            assert scale_name is not None   # _kind checked it
            try:
                return [(name, fp8.dequantize_blocks(t, tensors[scale_name]))]
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None
        q, scale_inv = fp8.quantize_blocks(t)
        return [(name, fp8.dequantize_blocks(q, scale_inv))]


def create_quantizer(method: Optional[str], names: Iterable[str]) -> NoQuantizer:
    """``WeightQuantizer`` for ``method``, `NoQuantizer` for None."""
    return NoQuantizer() if method is None else WeightQuantizer(method, names)
