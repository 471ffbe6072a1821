"""Parity with transformers in low precision, where exact token equality is not a fair ask.

In bf16 two implementations that are both correct round differently, so greedy decoding can
part ways at a near tie. The rule used by the GPU tests and ``benchmarks/gpu_check.py``:

* tokens must agree from the start up to the first step where transformers' own top-2 logit
  gap is at most ``min_gap`` (after a near tie either choice is right, and the texts diverge);
* the engine's returned logprobs, teacher-forced through transformers on the engine's own
  tokens (its decoder in bf16, its LM head in fp32 like ours), must be close (``max`` and
  ``mean`` absolute error bounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Tiny-model sizes every GPU backend can run (FlashInfer wants head_dim 64, 128 or 256).
GPU_TINY_SIZES = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
# bf16 keeps 8 significant bits; two correct bf16 decoders that order their sums differently
# give logprobs up to ~0.05 apart on the tiny models (seen on CPU: max 0.05, mean <= 0.013).
MIN_TOP2_GAP = 0.05
LOGPROB_MAX_ERR = 0.1
LOGPROB_MEAN_ERR = 0.02


@dataclass
class ParityReport:
    """Result of comparing one engine output with transformers on the same prompt."""

    agreed_tokens: int            # leading tokens equal before the first near tie (or the end)
    compared_tokens: int          # tokens before the first near tie
    first_mismatch: int | None    # index of a disagreement *before* any near tie, else None
    logprob_max_err: float
    logprob_mean_err: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.first_mismatch is None and self.logprob_max_err <= LOGPROB_MAX_ERR
                and self.logprob_mean_err <= LOGPROB_MEAN_ERR)


def load_hf(path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy_with_gaps(model: torch.nn.Module, prompt: list[int], max_new_tokens: int
                        ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, its top-1 minus top-2 logit."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


@torch.inference_mode()
def hf_token_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``lp[i] = log p(ids[i] | ids[:i])`` for i >= 1 (float32, on CPU; lp[0] is nan).

    The decoder runs in the model's dtype; the LM head is applied in float32 (as the engine
    does), so the comparison measures the decoder's rounding, not transformers' bf16 logits.
    """
    device = next(model.parameters()).device
    hidden = model.model(torch.tensor([ids], device=device)).last_hidden_state[0]
    logits = hidden.float() @ model.lm_head.weight.float().t()
    lp = torch.log_softmax(logits, dim=-1)
    out = torch.full((len(ids),), float("nan"))
    target = torch.tensor(ids[1:], device=device)[:, None]
    out[1:] = lp[:-1].gather(1, target).squeeze(1).cpu()
    return out


def compare(prompt: list[int], ours: list[int], our_logprobs: list[float], ref: list[int],
            gaps: list[float], ref_logprobs_of_ours: torch.Tensor,
            min_gap: float = MIN_TOP2_GAP) -> ParityReport:
    """Apply the rule above. ``ref_logprobs_of_ours`` is ``hf_token_logprobs(prompt + ours)``."""
    compared = next((i for i, g in enumerate(gaps) if g <= min_gap), len(gaps))
    compared = min(compared, len(ours), len(ref))
    mismatch = next((i for i in range(compared) if ours[i] != ref[i]), None)
    agreed = next((i for i in range(min(len(ours), len(ref))) if ours[i] != ref[i]),
                  min(len(ours), len(ref)))
    ref_lp = ref_logprobs_of_ours[len(prompt):len(prompt) + len(ours)].tolist()
    errs = [abs(a - b) for a, b in zip(our_logprobs, ref_lp)]
    return ParityReport(
        agreed_tokens=agreed, compared_tokens=compared, first_mismatch=mismatch,
        logprob_max_err=max(errs, default=0.0),
        logprob_mean_err=sum(errs) / len(errs) if errs else 0.0,
        details={"min_gap": min(gaps, default=float("inf"))})


def engine_vs_hf(engine: Any, hf_model: torch.nn.Module, prompts: list[list[int]],
                 max_new_tokens: int) -> list[ParityReport]:
    """Greedy-generate ``prompts`` with ``engine`` (one batch) and compare each with ``hf``."""
    outs = engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": max_new_tokens},
        return_logprob=True)
    reports = []
    for prompt, out in zip(prompts, outs):
        ours = out["output_ids"]
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref, gaps = hf_greedy_with_gaps(hf_model, prompt, max_new_tokens)
        reports.append(compare(prompt, ours, lps, ref, gaps,
                               hf_token_logprobs(hf_model, prompt + ours)))
    return reports
