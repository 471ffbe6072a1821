"""What the two GRPO examples share: the task (single-digit addition), its reward, the tiny
model, the supervised warm-start, the trainer's re-scoring and the clipped GRPO loss.

Task: the prompt is ``<bos>a+b=`` (a, b in 0..9, one token per digit); the answer is the sum's
digits then ``<eos>``. Reward: 1.0 for the exact answer, else partial credit: 0.5 x the
fraction of answer positions (digits, ``<eos>``) it gets right. Accuracy is the exact-match rate. Because the whole
task is 100 problems, the trainer can also compute the *expected* accuracy at temperature 1
exactly (the mean probability of the correct completion), a noise-free learning curve.

What limits the final accuracy is exploration: GRPO sharpens the policy (entropy ~1.2 -> ~0.05),
and a problem the policy answers wrongly with near certainty never yields a correct sample,
hence no signal. A gentle warm-start (small learning rate, more steps) leaves more probability
on the right answers and so ends higher (seed 0: 22% -> ~61-70%; seeds 1, 2: -> 76%, 67%).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch
from grpo_moe import MOE_MODEL_SPEC, own_routing, replayed, router_grad_norm, routing_mismatch

# the tiny dense model the examples train: ~0.6M parameters, learns the task in minutes on 2
# cores (--moe: grpo_moe.MOE_MODEL_SPEC)
MODEL_SPEC = dict(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=512)
MAX_NEW_TOKENS = 4          # longest answer is "18" + <eos>; room for one malformed token
PROBE_TEXT = "7+8=15"       # the fixed sequence whose logprobs must match after every refit
PARTIAL_CREDIT = 0.5        # reward share of a wrong answer with some right digits
LOGPROB_TOL = 1e-4          # float32 on CPU: engine and trainer agree to ~1e-6
# quantized rollouts: the probe against the trainer's model fake-quantized the same way
# (trainer_bridge.quantized_reference): 0 at most steps, but where an activation sits on a
# rounding edge of its quantization the two sides round it apart (seen over 300 steps: mean
# |dlogp| up to 0.045 with int8, 0.067 with fp8's 3-bit mantissa); the stale-KV and version
# checks stay exact
QUANT_PROBE_TOL = {"w8a8_int8": 0.1, "fp8": 0.25}


# -- model ---------------------------------------------------------------------------------------
def model_spec(moe: bool) -> dict[str, Any]:
    """The dense MODEL_SPEC, or with ``moe`` the tiny Qwen3-MoE's (``grpo_moe``)."""
    return dict(MOE_MODEL_SPEC if moe else MODEL_SPEC)


def ensure_model(model_dir: Path, seed: int, moe: bool = False) -> Path:
    """A tiny model directory with ``model_spec(moe)`` at ``model_dir`` (``make_tiny_model``,
    or ``make_tiny_moe`` with ``moe``): built if missing; rebuilt if it was built by us with
    another spec or seed (its marker records both, so a dense directory is never taken for
    a MoE one, nor the reverse)."""
    want = {**model_spec(moe), "seed": seed}
    marker = model_dir / "grpo_spec.json"
    if marker.is_file():
        if json.loads(marker.read_text()) == want:
            return model_dir
        import shutil
        shutil.rmtree(model_dir)
    elif model_dir.exists() and any(model_dir.iterdir()):
        raise FileExistsError(f"{model_dir} exists and was not made by this example")
    spec = model_spec(moe)
    arch = spec.pop("arch")
    if moe:
        from rollout_engine.testing.tiny_moe import make_tiny_moe
        make_tiny_moe(model_dir, arch, seed=seed, **spec)
    else:
        from rollout_engine.testing.tiny_model import make_tiny_model
        make_tiny_model(model_dir, arch, seed=seed, **spec)
    marker.write_text(json.dumps(want))
    return model_dir


def load_trainer_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    return model


# -- task ----------------------------------------------------------------------------------------
class AdditionTask:
    """``a+b=`` for a, b in 0..9, tokenized with the model's own tokenizer."""

    def __init__(self, tokenizer: Any, partial_credit: float = PARTIAL_CREDIT) -> None:
        self.tok = tokenizer
        self.partial_credit = partial_credit
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.problems = [(a, b) for a in range(10) for b in range(10)]
        self.prompts = [self.encode(f"{a}+{b}=") for a, b in self.problems]
        self.answers = [self.tok.encode(str(a + b), add_special_tokens=False) + [self.eos]
                        for a, b in self.problems]
        self.probe = self.encode(PROBE_TEXT) + [self.eos]

    def encode(self, text: str) -> list[int]:
        return [self.bos] + self.tok.encode(text, add_special_tokens=False)

    def sample(self, rng: random.Random, k: int) -> list[int]:
        """Indices of ``k`` distinct problems."""
        return rng.sample(range(len(self.problems)), k)

    def score(self, index: int, output_ids: list[int]) -> tuple[float, bool]:
        """(reward, exact) of one completion of problem ``index``: 1.0 when exact, else partial
        credit ``partial_credit`` x the fraction of positions (digits and <eos>) that match."""
        answer = self.answers[index]
        if output_ids == answer:
            return 1.0, True
        if self.partial_credit == 0.0:
            return 0.0, False
        hits = sum(a == b for a, b in zip(output_ids, answer))
        return self.partial_credit * hits / max(len(output_ids), len(answer)), False


# -- trainer-side scoring ------------------------------------------------------------------------
def pad_batch(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]],
                        completions: list[list[int]], pad: int, with_entropy: bool = False
                        ) -> tuple[torch.Tensor, ...]:
    """log p(completion token | prefix) at temperature 1 for every completion token.

    Returns (logprobs [B, T], mask [B, T]) where T is the longest completion; row i holds the
    logprobs of ``completions[i]`` left-aligned, mask 1 where a token exists; with
    ``with_entropy`` also the entropy [B, T] of the full next-token distribution there."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids, attn = pad_batch(seqs, pad)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    width = max(1, max(len(c) for c in completions))
    rows, cols, src = [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        for j in range(len(c)):
            rows.append(i)
            cols.append(j)
            src.append(len(p) - 1 + j)   # the position whose logits predict completion token j
    r, c_, s_ = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), \
        torch.tensor(src, dtype=torch.long)
    logp_all = torch.log_softmax(logits[r, s_], dim=-1)                     # [N, V]
    targets = ids[r, s_ + 1]
    out = torch.zeros((len(seqs), width)).index_put((r, c_), logp_all.gather(
        -1, targets[:, None]).squeeze(-1))
    mask = torch.zeros((len(seqs), width))
    mask[r, c_] = 1.0
    if not with_entropy:
        return out, mask
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return out, mask, torch.zeros((len(seqs), width)).index_put((r, c_), ent)


def expected_accuracy(model: torch.nn.Module, task: AdditionTask) -> float:
    """Mean over all 100 problems of p(exact answer) when sampling at temperature 1."""
    with torch.no_grad():
        logp, mask = completion_logprobs(model, task.prompts, task.answers, task.eos)
    return float((logp * mask).sum(-1).exp().mean())


def probe_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The trainer's logprob of each token of ``ids`` after the first (what the engine returns
    as ``input_token_logprobs[1:]`` with ``logprob_start_len=0``)."""
    with torch.no_grad():
        lp, _ = completion_logprobs(model, [ids[:1]], [ids[1:]], 0)
    return lp[0].tolist()


def probe_delta(engine_out: dict[str, Any], trainer_lps: list[float]) -> float:
    """Mean |engine - trainer| over the probe's tokens."""
    engine_lps = [x[0] for x in engine_out["meta_info"]["input_token_logprobs"][1:]]
    if len(engine_lps) != len(trainer_lps):
        raise AssertionError(f"probe: engine gave {len(engine_lps)} logprobs, "
                             f"trainer {len(trainer_lps)}")
    return sum(abs(a - b) for a, b in zip(engine_lps, trainer_lps)) / len(trainer_lps)


# -- warm start ----------------------------------------------------------------------------------
def warm_start(model: torch.nn.Module, task: AdditionTask, target: float, lr: float,
               max_seconds: float, seed: int) -> dict[str, float]:
    """Supervised steps on all 100 problems, stopped as soon as the expected accuracy reaches
    ``target`` (deliberately partial: RL gets the rest). Returns what it did."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start, steps, acc = time.perf_counter(), 0, expected_accuracy(model, task)
    while acc < target and time.perf_counter() - start < max_seconds:
        logp, mask = completion_logprobs(model, task.prompts, task.answers, task.eos)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        acc = expected_accuracy(model, task)
    return {"warm_start_steps": steps, "warm_start_seconds": time.perf_counter() - start,
            "warm_start_expected_accuracy": acc}


# -- GRPO ----------------------------------------------------------------------------------------
def group_advantages(rewards: list[float], n: int, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """r - mean of its group, divided by the group's std + eps when ``std_norm`` (GRPO; off:
    Dr. GRPO); groups are consecutive runs of n."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, n)
    adv = r - r.mean(-1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(-1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def mismatch_stats(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, float]:
    """Rollout-vs-trainer logprob mismatch: mean |delta| and the K3 estimate of
    KL(rollout || trainer), ``(r - 1) - log r`` with ``r = p_trainer / p_rollout``."""
    d = (trainer_lp - rollout_lp) * mask
    k3 = (torch.exp(d) - 1 - d) * mask
    tokens = mask.sum().clamp(min=1)
    return {"logprob_abs_diff": float(d.abs().sum() / tokens),
            "logprob_max_abs_diff": float(d.abs().max()),
            "kl_k3": float(k3.sum() / tokens)}


def grpo_loss(new_lp: torch.Tensor, rollout_lp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean clipped policy-gradient loss; the importance ratio is against the rollout
    logprobs (the engine's, not a trainer recompute)."""
    ratio = torch.exp(new_lp - rollout_lp)
    a = adv[:, None]
    unclipped, clipped = ratio * a, ratio.clamp(1 - clip, 1 + clip) * a
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / tokens
    clip_frac = (((unclipped - clipped).abs() > 1e-8).float() * mask).sum() / tokens
    return loss, {"clip_frac": float(clip_frac)}


def on_policy_logprobs(scorer: Any, model: torch.nn.Module, prompts: list[list[int]],
                       completions: list[list[int]],
                       records: Optional[list[torch.Tensor]] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_logprobs`` (no entropy) by ``trainer_bridge.on_policy.OnPolicyModel``
    ``scorer`` holding ``model``'s current weights: bit for bit the logprobs a deterministic
    engine returned for these tokens (replaying each rollout's ``records`` when given)."""
    from rollout_engine.weights.loader import load_weights

    load_weights(scorer.model, [(k, v.detach()) for k, v in model.state_dict().items()])
    width = max(1, max(len(c) for c in completions))
    out, mask = torch.zeros((len(prompts), width)), torch.zeros((len(prompts), width))
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if c:
                out[i, :len(c)] = scorer.token_logprobs(
                    p + c, len(p), routed_experts=None if records is None else records[i])
                mask[i, :len(c)] = 1.0
    return out, mask


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, prompts: list[list[int]],
               completions: list[list[int]], rollout_lps: list[list[float]],
               rewards: list[float], n: int, pad: int, clip: float, minibatches: int,
               entropy_coef: float = 0.0, std_norm: bool = True,
               max_grad_norm: float = 1.0, scorer: Any = None,
               routed_experts: Optional[list[torch.Tensor]] = None) -> dict[str, float]:
    """Re-score the rollout tokens (mismatch, before any update; by ``scorer``, an
    ``OnPolicyModel``, when given), then one pass of ``minibatches`` clipped-GRPO updates over
    the groups (minus ``entropy_coef`` x the token-mean entropy: keeps the policy exploring).

    ``routed_experts`` (a MoE model; one record per rollout, ``grpo_moe.decode_records``):
    the re-scoring and every loss forward and backward replay the rollout's routing, and
    ``routing_mismatch`` says how often the trainer's own router would have chosen otherwise
    (``logprob_abs_diff_unreplayed``: the mismatch it would have left); ``router_grad_norm``:
    the routers' gradient norm in the updates (mean, before clipping)."""
    adv = group_advantages(rewards, n, std_norm)
    with torch.no_grad():
        if scorer is not None:
            old_lp, mask = on_policy_logprobs(scorer, model, prompts, completions,
                                              routed_experts)
        else:
            with replayed(model, prompts, completions, routed_experts):
                old_lp, mask = completion_logprobs(model, prompts, completions, pad)
    rollout_lp = torch.zeros_like(old_lp)
    for i, lps in enumerate(rollout_lps):
        rollout_lp[i, :len(lps)] = torch.tensor(lps)
    stats = mismatch_stats(old_lp, rollout_lp, mask)
    if routed_experts is not None:
        with torch.no_grad(), own_routing(model) as chosen:
            own_lp, _ = completion_logprobs(model, prompts, completions, pad)
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        stats["routing_mismatch"] = routing_mismatch(chosen, routed_experts, width)
        stats["logprob_abs_diff_unreplayed"] = mismatch_stats(
            own_lp, rollout_lp, mask)["logprob_abs_diff"]
    groups = len(rewards) // n
    per_mb = max(1, math.ceil(groups / minibatches))
    losses, clips, ents, router_grads = [], [], [], []
    for g0 in range(0, groups, per_mb):
        rows = list(range(g0 * n, min(groups, g0 + per_mb) * n))
        if not bool(adv[rows].abs().sum() > 0):
            continue  # every group here had equal rewards: no signal
        mb_prompts, mb_completions = [prompts[i] for i in rows], [completions[i] for i in rows]
        records = None if routed_experts is None else [routed_experts[i] for i in rows]
        with replayed(model, mb_prompts, mb_completions, records):
            new_lp, mb_mask, ent = completion_logprobs(model, mb_prompts, mb_completions, pad,
                                                       True)
            w = mb_mask.shape[1]
            loss, info = grpo_loss(new_lp, rollout_lp[rows, :w], adv[rows], mb_mask, clip)
            entropy = (ent * mb_mask).sum() / mb_mask.sum()
            if entropy_coef:
                loss = loss - entropy_coef * entropy
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if records is not None:
            router_grads.append(router_grad_norm(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        clips.append(info["clip_frac"])
        ents.append(float(entropy.detach()))
    stats["loss"] = sum(losses) / len(losses) if losses else 0.0
    stats["clip_frac"] = sum(clips) / len(clips) if clips else 0.0
    stats["entropy"] = sum(ents) / len(ents) if ents else float("nan")
    stats["updates"] = len(losses)
    if routed_experts is not None:
        stats["replayed_updates"] = len(router_grads)
        stats["router_grad_norm"] = sum(router_grads) / len(router_grads) if router_grads else 0.0
    return stats
