"""The quantized schemes' reference: transformers' model of the same directory with every
decoder linear replaced by plain-PyTorch fake quantization (weights quantized and dequantized
once; each input quantized and dequantized per token, or per token group for fp8), run in
float32 (trainer_bridge/quantized_reference.py, written from the schemes' definitions, not from
rollout_engine.quantization)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

from trainer_bridge.quantized_reference import FakeQuantLinear, fake_quantized


@functools.lru_cache(maxsize=8)
def quantized_hf_model(path: str, method: str) -> torch.nn.Module:
    return fake_quantized(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          method)


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
