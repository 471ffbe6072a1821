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


@torch.inference_mode()
def hf_routed_experts(path: str, ids: list[int]) -> torch.Tensor:
    """The experts transformers' routers pick for ``ids[:-1]`` (every token a rollout feeds to
    the model), as SGLang returns them: ``[len(ids) - 1, num_hidden_layers, top_k]`` int32,
    top-k of softmax(router logits) in each MoE layer, -1 in the dense layers."""
    model = hf_model(path)
    cfg = model.config
    router_logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe_layers = [i for i in range(cfg.num_hidden_layers)
                  if i not in dense and (i + 1) % step == 0]
    assert len(router_logits) == len(moe_layers)
    out = torch.full((len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1,
                     dtype=torch.int32)
    for layer, logits in zip(moe_layers, router_logits):
        probs = torch.softmax(logits.float(), dim=-1)[:len(ids) - 1]
        out[:, layer] = torch.topk(probs, cfg.num_experts_per_tok, dim=-1).indices.to(torch.int32)
    return out
