"""The trainer's side of true on-policy rollouts: a model whose logprobs equal, bit for bit, the
ones an engine started with ``enable_deterministic_inference`` returned when it sampled.

``OnPolicyModel(model_path)`` holds the engine's own model class (Llama, Qwen2, Qwen3 and the
MoE variants) with the checkpoint's weights as trainable parameters. ``token_logprobs(ids, start, ...)`` scores a whole
sequence in one forward: entry ``j`` is ``log p(ids[start + j] | ids[:start + j])``.

- Its *values* come from the engine's batch-invariant path (``models/batch_invariant.py``):
  the same products, attention rows, norms and RoPE kernels, then the sampler kernel's own
  logprob of the given token (``FusedOps.token_logprobs``, the same pass and expression as
  ``sample_rows``). Every reduction there is fixed per row, so a position's logprob is the
  engine's whatever batch, chunking, radix hit or thread count produced it, and whatever
  thread count the trainer uses.
- Its *gradient* is that of the same function written in plain differentiable torch ops
  (``reference_logits``: RMSNorm, RoPE, causal SDPA with GQA, SiLU, the experts' router and
  MLPs, the tied or untied LM head, ``log_softmax(logits / T)``), recomputed in ``backward``. The two paths agree to
  float32 rounding (~1e-6), so the gradient is the logprob's.

Sampling arguments: ``temperature`` (0: greedy, scored at T = 1), ``top_k`` and ``min_p`` as
the request had them (they choose the kernel's pass, not the value's definition). Rows the
engine sampled with ``top_p < 1``, with penalties or a grammar, or that asked for top
logprobs take PyTorch's ``log_softmax`` there instead: score those with
``reference_logits`` (equal within ~1e-6, not bit for bit).

Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE) score the same way. ``routed_experts``
(the engine's record of the rollout, `routing_replay.decode_routed_experts`: ``[len(ids) - 1,
num_hidden_layers, top_k]``) replays the rollout's experts in both paths (R3: ids given, gates
from this router's softmax). Without it the model routes by its own top-k, and the backward
replays whatever the value path chose, so the gradient is always that of the returned values.

After a refit the trainer's parameters are what it sent; ``load_state_dict`` or in-place
optimiser steps change them, and the next call scores with the new values.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu.fused_ops import load_fused_ops
from torch import nn

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
from rollout_engine.models import batch_invariant
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.models.layers import RotaryEmbedding, rms_norm_ref, silu_mul_ref
from rollout_engine.models.llama import ModelArch
from rollout_engine.models.moe import SparseMoeBlock, route
from rollout_engine.models.registry import build_model
from rollout_engine.weights.loader import iter_safetensors, load_weights, read_hf_config
from trainer_bridge.routing_replay import select_moe_layers


class OnPolicyModel(nn.Module):
    """See the module docstring. ``model`` is the engine's ``LlamaForCausalLM``; its
    parameters (HF names through ``model.weight_map()``) are this module's."""

    def __init__(self, model_path: str) -> None:
        super().__init__()
        self.arch = ModelArch.from_hf_config(read_hf_config(model_path))
        self.model = build_model(self.arch)
        load_weights(self.model, iter_safetensors(model_path), require_all=True)
        if load_fused_ops() is None:
            raise RuntimeError("OnPolicyModel needs the CPU fused ops, which could not be built")
        batch_invariant.kernel()

    def token_logprobs(self, ids: Any, start: int = 1, temperature: float = 1.0,
                       top_k: int = -1, min_p: float = 0.0,
                       routed_experts: Optional[Any] = None) -> torch.Tensor:
        """``[len(ids) - start]`` float32: the logprob of each token from ``start`` on, given
        the tokens before it (see the module docstring); differentiable in the parameters.
        ``routed_experts``: the rollout's routing to replay (MoE models only)."""
        ids = self._check_ids(ids, start)
        if temperature < 0 or min_p < 0:
            raise ValueError(f"temperature and min_p must be >= 0, got {temperature}, {min_p}")
        sampling = (float(temperature), int(top_k), float(min_p))
        routing = self._routing_in(routed_experts, ids.numel())
        params = [p for p in self.model.parameters()]
        return _Logprobs.apply(self, ids, start, sampling, routing, *params)

    def _routing_in(self, routed_experts: Optional[Any], num_tokens: int
                   ) -> Optional[torch.Tensor]:
        """The engine's record of a sequence of ``num_tokens`` tokens (``[num_tokens - 1``
        or ``num_tokens, num_hidden_layers, top_k]``) as the model's ``routing_in`` for its
        first ``num_tokens - 1`` tokens: ``[num_tokens - 1, MoE layers, top_k]`` int64.
        ValueError when it does not fit the model."""
        if routed_experts is None:
            return None
        moe = self.arch.moe
        if moe is None:
            raise ValueError("routed_experts given, but this model has no MoE layers")
        ids = select_moe_layers(routed_experts, self.arch.num_layers, moe.moe_layers,
                                moe.top_k, moe.num_experts)
        if ids.dim() != 3 or ids.shape[0] not in (num_tokens - 1, num_tokens):
            shape = tuple(torch.as_tensor(routed_experts).shape)
            raise ValueError(f"routed_experts has shape {shape}; a sequence of {num_tokens} "
                             f"tokens needs [{num_tokens - 1}, {self.arch.num_layers}, "
                             f"{moe.top_k}] (every token but the last)")
        return ids[:num_tokens - 1].contiguous()

    def _check_ids(self, ids: Any, start: int) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if not 1 <= start < ids.numel():
            raise ValueError(f"start must be in [1, {ids.numel()}), got {start}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.arch.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.arch.vocab_size})")
        return ids

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight under its checkpoint (HF) name, as views of the parameters: what a
        refit sends (``Engine.update_weights_from_tensor``) after an optimiser step."""
        return [(name, param.detach().narrow(0, row0, rows) if param.dim() else param.detach())
                for name, (param, row0, rows) in self.model.weight_map().items()]

    @torch.no_grad()
    def engine_logprobs(self, ids: torch.Tensor, start: int, sampling: tuple[float, int, float],
                        routing: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The values: the engine's batch-invariant forward over every token but the last
        (whose output scores nothing) and the sampler kernel. Returns them and, for a MoE
        model, the routing that forward used (``routing`` when given, else its own)."""
        model, arch, n = self.model, self.arch, ids.numel() - 1
        pool = KVPool(n, arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32,
                      torch.device("cpu"))
        table = ReqToTokenPool(1, n, torch.device("cpu"))
        row = table.allocate()
        assert row is not None
        table.write(row, 0, list(range(n)))
        backend = TorchNativeBackend(pool, table, batch_invariant=True)
        positions = torch.arange(n, dtype=torch.int64)
        fb = ForwardBatch(
            ForwardMode.EXTEND, input_ids=ids[:n], positions=positions, out_cache_loc=positions,
            req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([n]),
            prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([n]),
            logits_indices=torch.arange(start - 1, n), seq_lens_list=[n],
            prefix_lens_list=[0], extend_lens_list=[n])
        fb.attn_backend = backend
        if arch.moe is not None:   # the MoE layers read routing_in / write routing_out
            if routing is None:
                routing = torch.empty(n, len(arch.moe.moe_layers), arch.moe.top_k,
                                      dtype=torch.int64)
                fb.routing_out = routing   # type: ignore[attr-defined]
            else:
                fb.routing_in = routing    # type: ignore[attr-defined]
        backend.init_forward_metadata(fb)
        with batch_invariant.forwards(True):
            hidden = model(fb.input_ids, fb.positions, fb)
            logits = model.compute_logits(hidden[fb.logits_indices]).contiguous()
        t, top_k, min_p = sampling
        rows = n + 1 - start
        greedy = t == 0 or top_k == 1
        ops = load_fused_ops()
        assert ops is not None
        top_ks = (torch.full((rows,), top_k, dtype=torch.int64)
                  if 0 < top_k < arch.vocab_size else None)
        return ops.token_logprobs(
            logits, torch.full((rows,), t if t > 0 else 1.0, dtype=torch.float32),
            torch.full((rows,), min_p, dtype=torch.float32),
            torch.full((rows,), int(greedy), dtype=torch.uint8), ids[start:].contiguous(),
            top_ks), routing

    def reference_logprobs(self, ids: Any, start: int, temperature: float,
                           routed_experts: Optional[Any] = None) -> torch.Tensor:
        """The same logprobs in plain torch ops (differentiable; equal to float rounding);
        ``routed_experts`` as `token_logprobs` takes it."""
        ids = self._check_ids(ids, start)
        return self._reference(ids, start, temperature,
                               self._routing_in(routed_experts, ids.numel()))

    def _reference(self, ids: torch.Tensor, start: int, temperature: float,
                   routing: Optional[torch.Tensor]) -> torch.Tensor:
        logits = reference_logits(self.model, ids[:-1], routing)[start - 1:]
        t = temperature if temperature > 0 else 1.0
        lp = torch.log_softmax(logits / t, dim=-1)
        return lp.gather(1, ids[start:, None]).squeeze(1)


class _Logprobs(torch.autograd.Function):
    """Values from the kernels, gradient from the torch reference of the same function."""

    @staticmethod
    def forward(ctx: Any, owner: OnPolicyModel, ids: torch.Tensor, start: int,
                sampling: tuple[float, int, float], routing: Optional[torch.Tensor],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.owner, ctx.start, ctx.temperature = owner, start, sampling[0]
        values, ctx.routing = owner.engine_logprobs(ids, start, sampling, routing)
        ctx.save_for_backward(ids)
        return values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        params = list(ctx.owner.model.parameters())
        with torch.enable_grad():   # through the experts the values went through
            ref = ctx.owner._reference(ids, ctx.start, ctx.temperature, ctx.routing)
            wanted = [p for p in params if p.requires_grad]
            got = iter(torch.autograd.grad(ref, wanted, grad, allow_unused=True))
        grads = [next(got) if p.requires_grad else None for p in params]
        return (None, None, None, None, None, *grads)


def reference_logits(model: nn.Module, ids: torch.Tensor,
                     routing: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits ``[L, V]`` of the engine's ``LlamaForCausalLM`` over one sequence, in plain
    differentiable torch ops (the math of ``transformers``' Llama / Qwen2 / Qwen3 and their
    MoE variants). ``routing`` (``[L, MoE layers, top_k]``, the model's ``routing_in``)
    replays those experts; without it each MoE layer takes its router's top-k."""
    arch = model.arch
    n, eps = ids.numel(), arch.rms_norm_eps
    x = F.embedding(ids, model.embed_tokens.weight)
    cos, sin = model.rotary.cos_sin(torch.arange(n), x.dtype)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = rms_norm_ref(x, layer.input_layernorm.weight, eps)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = qkv.split(attn.qkv_proj.shard_sizes, dim=-1)
        q = q.reshape(n, attn.num_heads, attn.head_dim)
        k = k.reshape(n, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = rms_norm_ref(q, attn.q_norm.weight, eps), rms_norm_ref(k, attn.k_norm.weight, eps)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=attn.scaling, enable_gqa=True)
        o = o[0].transpose(0, 1).reshape(n, -1)
        x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
        h = rms_norm_ref(x, layer.post_attention_layernorm.weight, eps)
        if isinstance(mlp, SparseMoeBlock):
            x = x + _moe_ref(mlp, h, None if routing is None else routing[:, mlp.column])
        else:
            x = x + _mlp_ref(mlp, h)
    x = rms_norm_ref(x, model.norm.weight, eps)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, head)


def _mlp_ref(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    gate_up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
    return F.linear(silu_mul_ref(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)


def _moe_ref(mlp: SparseMoeBlock, h: torch.Tensor, chosen: Optional[torch.Tensor]
             ) -> torch.Tensor:
    """``SparseMoeBlock`` in differentiable ops: the router's gates (at ``chosen`` when
    given), each expert in use over its tokens, Qwen2-MoE's gated shared expert."""
    moe = mlp.moe
    weights, ids = route(F.linear(h, mlp.gate.weight), moe.top_k, moe.norm_topk_prob, chosen)
    w13 = mlp.w13.view(moe.num_experts, 2 * mlp.expert_size, -1)
    w2 = mlp.w2.view(moe.num_experts, -1, mlp.expert_size)
    out = torch.zeros_like(h)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        y = F.linear(silu_mul_ref(F.linear(h[tokens], w13[e])), w2[e])
        out = out.index_add(0, tokens, y * weights[tokens, slots, None])
    if mlp.shared is not None and mlp.shared_gate is not None:
        out = out + torch.sigmoid(F.linear(h, mlp.shared_gate.weight)) * _mlp_ref(mlp.shared, h)
    return out
