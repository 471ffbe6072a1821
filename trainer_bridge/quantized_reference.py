"""The trainer's view of a quantized engine: its own transformers model with every decoder
linear replaced by plain-PyTorch fake quantization of the engine's schemes (weights quantized and
dequantized once; each input quantized and dequantized per token, or per token group for fp8),
run in float32. A trainer scoring with ``fake_quantized(model, method)`` sees the policy the
rollouts were sampled from (up to activations on a rounding edge); scoring with the plain model
measures the train-inference mismatch the quantization costs. Written from the schemes'
definitions (docs/API.md), not from ``rollout_engine.quantization``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

__all__ = ["fake_quantized", "FakeQuantLinear", "int8_weight", "int8_tokens", "fp8_weight",
           "fp8_tokens", "PROJECTIONS"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def int8_weight(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8, dequantized."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8, dequantized (rows of the last dim)."""
    return int8_weight(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def fp8_weight(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """e4m3 in block x block tiles, one scale (amax / 448) each, dequantized."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], block):
        for c in range(0, w.shape[1], block):
            tile = w[r:r + block, c:c + block]
            amax = tile.abs().max()
            scale = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            q = (tile / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[r:r + block, c:c + block] = q.float() * scale
    return out


def fp8_tokens(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """e4m3 per token and group of ``group`` features, dequantized."""
    out = torch.empty_like(x)
    for c in range(0, x.shape[-1], group):
        part = x[..., c:c + group]
        amax = part.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out[..., c:c + group] = q.float() * scale
    return out


class FakeQuantLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, method: str) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.weight = int8_weight(w) if method == "w8a8_int8" else fp8_weight(w)
        self.bias = linear.bias
        self.tokens = int8_tokens if method == "w8a8_int8" else fp8_tokens
        self.jitter = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tokens(x * (1 + self.jitter)), self.weight, self.bias)


def fake_quantized(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """A copy of a transformers causal LM whose decoder linears run ``method``'s fake
    quantization (``w8a8_int8`` or ``fp8``); ``model`` itself is unchanged."""
    if method not in ("w8a8_int8", "fp8"):
        raise ValueError(f"method: must be w8a8_int8 or fp8, got {method!r}")
    out = copy.deepcopy(model).float().eval()
    for layer in out.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, FakeQuantLinear(getattr(parent, name), method))
    return out
