"""The decoder's linears under ``--quantization`` (``rollout_engine/quantization``).

    Int8Linear / Int8MergedLinear   ``weight`` int8 ``[N, K]``, ``weight_scale`` float32
                                    ``[N, 1]`` (SGLang's and compressed-tensors' names), bias
                                    in the model's dtype; the product: on CPU in float32 the
                                    compiled kernel (`int8.cpu_kernel`, the weight in place),
                                    else `int8.int8_linear` on oneDNN's packed copy, else
                                    `int8.int8_linear_ref`
    Fp8Linear / Fp8MergedLinear     the plain layers, whose weight holds the dequantized
                                    blocks; each product's input quantized and dequantized
                                    per token group first (CPU emulation)

oneDNN's packed int8 copies (only where the kernel is not built) are kept the way ``weight_packs`` keeps oneDNN's float32 ones: made at the
first product after a write, keyed by the weight generation (``weight_writes``), the storage
addresses and autograd versions of the weight and its scales, and all dropped when the
generation moves (a refit, a shadow swap, sleep or wake).
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
from torch import nn

from rollout_engine.models import weight_writes
from rollout_engine.models.layers import Linear, MergedLinear, linear
from rollout_engine.quantization import fp8, int8

__all__ = ["Fp8Linear", "Fp8MergedLinear", "Int8Linear", "Int8MergedLinear", "QUANTIZED",
           "keep_scales_float32", "make_linear", "make_merged", "num_packed_bytes"]

# id(weight) -> (weakref to the weight, key it was packed under, packed copy)
_packs: dict[int, tuple[weakref.ref, tuple, int8.Int8Weight]] = {}
weight_writes.on_change(_packs.clear)


def num_packed_bytes() -> int:
    """Memory held by the packed int8 copies (their elements)."""
    return sum(p.packed.numel() for _, _, p in _packs.values())


def _version(t: torch.Tensor) -> Optional[int]:
    return None if t.is_inference() else t._version


def _key(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
    return (weight_writes.generation(), weight.data_ptr(), _version(weight),
            scale.data_ptr(), _version(scale))


def _forget(key: int) -> None:
    _packs.pop(key, None)


def _packed(weight: torch.Tensor, scale: torch.Tensor) -> Optional[int8.Int8Weight]:
    entry = _packs.get(id(weight))
    key = _key(weight, scale)
    if entry is not None and entry[0]() is weight and entry[1] == key:
        return entry[2]
    packed = int8.prepack(weight.detach(), scale.detach())
    if packed is not None:
        ident = id(weight)
        _packs[ident] = (weakref.ref(weight, lambda _, k=ident: _forget(k)), key, packed)
    return packed


class Int8Linear(nn.Module):
    """W8A8 int8 linear (module docstring); the parameters are filled by the weight loader
    (through ``quantization.convert``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = int8.cpu_kernel() if x.is_cpu and x.dtype is torch.float32 else None
        if kernel is not None and (self.bias is None or self.bias.dtype is torch.float32):
            return int8.kernel_linear(kernel, x, self.weight, self.weight_scale, self.bias)
        packed = _packed(self.weight, self.weight_scale) if x.is_cpu else None
        if packed is None:
            return int8.int8_linear_ref(x, self.weight, self.weight_scale, self.bias)
        return int8.int8_linear(x, packed, self.bias)


class Int8MergedLinear(Int8Linear):
    """`Int8Linear` of several HF projections stacked on the output rows (qkv, gate_up), as
    ``MergedLinear``: each projection's rows keep their own scales."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])


class Fp8Linear(Linear):
    """``Linear`` whose input is quantized to e4m3 per token group first (the weight holds
    dequantized blocks already)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(fp8.fake_quant_groups(x), self.weight, self.bias)


class Fp8MergedLinear(MergedLinear):
    """``MergedLinear`` with `Fp8Linear`'s input quantization."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(fp8.fake_quant_groups(x), self.weight, self.bias)


QUANTIZED = (Int8Linear, Fp8Linear, Fp8MergedLinear)
"""The layers whose product is not ``linear`` on their weight (Int8MergedLinear included)."""


def make_linear(in_features: int, out_features: int, bias: bool,
                method: Optional[str]) -> Union[Linear, Int8Linear]:
    """The decoder's plain projection (o_proj, down_proj) under ``method``."""
    if method == "w8a8_int8":
        return Int8Linear(in_features, out_features, bias)
    if method == "fp8":
        return Fp8Linear(in_features, out_features, bias=bias)
    return Linear(in_features, out_features, bias=bias)


def make_merged(in_features: int, shard_sizes: list[int], bias: bool,
                method: Optional[str]) -> Union[MergedLinear, Int8MergedLinear]:
    """The decoder's fused projection (qkv, gate_up) under ``method``."""
    if method == "w8a8_int8":
        return Int8MergedLinear(in_features, shard_sizes, bias)
    if method == "fp8":
        return Fp8MergedLinear(in_features, shard_sizes, bias)
    return MergedLinear(in_features, shard_sizes, bias)


def keep_scales_float32(model: nn.Module) -> None:
    """Give every int8 layer's ``weight_scale`` float32 storage again after ``model.to(dtype)``
    cast it (the scales and the rescale stay float32 whatever the model's dtype)."""
    with weight_writes.writing():   # new storage for a parameter: the generation moves
        for module in model.modules():
            if isinstance(module, Int8Linear) and module.weight_scale.dtype != torch.float32:
                module.weight_scale.data = module.weight_scale.data.float()
