"""transformers as the correctness reference: greedy generate and teacher-forced logprobs."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(path)
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                         max_new_tokens=max_new_tokens, attention_mask=torch.ones(1, len(prompt_ids),
                                                                                  dtype=torch.long))
    gen = out[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(gen):   # generate pads nothing at batch 1, but be exact about EOS
        if t in eos_ids:
            return gen[:i + 1]
    return gen


@torch.inference_mode()
def hf_logprobs(path: str, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``lp[i]`` = log p(ids[i] | ids[:i]) for i >= 1 (lp[0] is nan)."""
    logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.full((len(ids),), float("nan"))
    out[1:] = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return out
