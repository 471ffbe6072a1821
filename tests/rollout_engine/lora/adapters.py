"""Tiny PEFT adapters built with peft itself, and transformers + peft as the reference.

``make_adapter`` wraps the tiny base model with ``peft.get_peft_model``, gives ``lora_B`` random
values (peft starts it at zero, which would make every adapter the base model), and ``lora_A``
values of its seed too, and saves it with ``save_pretrained``. The reference for an adapter is the base model with the adapter
merged into its weights (``merge_and_unload``): greedy tokens and teacher-forced logprobs.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass
from typing import Any, Union

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

MLP = ["gate_proj", "up_proj", "down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    """What ``make_adapter`` builds: peft's ``LoraConfig`` arguments and the seed of B."""

    r: int
    alpha: float
    targets: Union[tuple[str, ...], str]
    rslora: bool = False
    seed: int = 0
    std: float = 0.05


SPECS = {
    # every projection, alpha != r
    "all8": AdapterSpec(8, 16, tuple(ATTN + MLP), seed=1),
    # rank 64, attention only (k and o left out: the fused qkv with a gap)
    "qv64": AdapterSpec(64, 32, ("q_proj", "v_proj"), seed=2, std=0.02),
    # rsLoRA (alpha / sqrt(r)), the MLP and o
    "mlp_rs": AdapterSpec(16, 8, ("o_proj", *MLP), rslora=True, seed=3),
    # PEFT's "all-linear"
    "linear4": AdapterSpec(4, 3, "all-linear", seed=4, std=0.1),
}


def make_adapter(base: str, out: str, spec: AdapterSpec) -> str:
    """A PEFT adapter directory for ``base`` (``adapter_config.json`` + safetensors)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets: Any = spec.targets if isinstance(spec.targets, str) else list(spec.targets)
    peft_model = get_peft_model(model, LoraConfig(r=spec.r, lora_alpha=spec.alpha,
                                                  target_modules=targets, lora_dropout=0.0,
                                                  use_rslora=spec.rslora))
    gen = torch.Generator().manual_seed(spec.seed)   # A too: peft draws it from the global RNG
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.std)
    peft_model.save_pretrained(out)
    return out


def adapter_tensors(path: str) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """An adapter directory's config and (name, tensor) pairs, as a trainer would send them."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return config, sorted(load_file(os.path.join(path, "adapter_model.safetensors")).items())


@functools.lru_cache(maxsize=16)
def merged(base: str, adapter: str) -> torch.nn.Module:
    """transformers' model of ``base`` with ``adapter`` merged in (peft's merge_and_unload)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@functools.lru_cache(maxsize=4)
def plain(base: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def reference_model(base: str, adapter: Union[str, None]) -> torch.nn.Module:
    return plain(base) if adapter is None else merged(base, adapter)


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens, cut after the first EOS."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    gen = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(gen):
        if t in eos_ids:
            return gen[:i + 1]
    return gen


@torch.inference_mode()
def logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """Teacher-forced log p(output[i] | prompt + output[:i])."""
    ids = prompt + output
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches(base: str, adapter: Union[str, None], prompt: list[int], result: dict,
                   max_new_tokens: int, tol: float = 1e-4) -> None:
    """``result`` (an engine's greedy output with logprobs) is the reference's: the same
    tokens, each logprob within ``tol``."""
    model = reference_model(base, adapter)
    expected = greedy(model, prompt, max_new_tokens)
    assert result["output_ids"] == expected, f"adapter {adapter}: tokens differ"
    ours = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
    theirs = logprobs(model, prompt, expected)
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst < tol, f"adapter {adapter}: logprob off by {worst:.2e}"
