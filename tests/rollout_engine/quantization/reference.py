"""The quantized schemes' reference: transformers' model of the same directory with every
decoder linear replaced by plain-PyTorch fake quantization (weights quantized and dequantized
once; each input quantized and dequantized per token, or per token group for fp8), run in
float32. Written from the schemes' definitions, not from rollout_engine.quantization."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

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


@functools.lru_cache(maxsize=8)
def quantized_hf_model(path: str, method: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, FakeQuantLinear(getattr(parent, name), method))
    return model


@torch.inference_mode()
def reference_greedy(path: str, method: str, prompt: list[int], max_new: int) -> list[int]:
    model = quantized_hf_model(path, method)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def reference_logprobs(path: str, method: str, ids: list[int], jitter: float = 0.0
                       ) -> list[float]:
    """``lp[i]`` = log p(ids[i] | ids[:i]) for i >= 1 (lp[0] is nan). ``jitter``: every
    linear's input scaled by ``1 + jitter`` before it is quantized. Two float32 computations
    of one activation differ by ~1e-7 relative, and an activation that close to a rounding
    edge of its quantization lands on the other side: a jitter of that size shows which
    outputs such an edge moves (and by how much)."""
    model = quantized_hf_model(path, method)
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            module.jitter = jitter
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float("nan")] + lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
