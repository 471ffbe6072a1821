"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE): a softmax router picks ``top_k`` of
``num_experts`` SwiGLU experts per token; Qwen2-MoE adds a shared expert behind a sigmoid gate.

Layout. A layer's experts live in two stacked parameters, flattened to two dimensions so every
Hugging Face per-expert tensor is a run of rows (the loader's ``(parameter, first row, rows)``
table covers them as it covers the dense model's fused projections):

    w13  [E * 2I, H]   expert e's gate_proj in rows [2Ie, 2Ie + I), its up_proj in the next I
    w2   [E * H, I]    expert e's down_proj in rows [He, He + H)

Transformers 5 names the same bytes ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]``: those load as a reshape of the whole parameter.

Compute. The ``T x top_k`` (token, expert) pairs are sorted by expert; each expert used in the
batch runs its gate_up and down products once over all of its tokens (``layers.linear``: packed
oneDNN weights, the small-GEMM kernel at decode sizes, batch-invariant products when that mode
is on), and the weighted results are summed back per token in expert order. No step loops over
tokens; a token's sum runs in the same order whatever else is in the batch.

Routing record and replay. With ``ForwardBatch.routing_out`` set (``[T, moe_layers, top_k]``)
each MoE layer writes the experts it picked for every token (rollout routing replay, R3); with
``routing_in`` set, the layers use those experts instead of their own top-k, gating them by
this router's probabilities (renormalised as the model does): the trainer's side of R3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from rollout_engine_kernels.cpu.moe_experts import MoeExperts, load_moe_experts
from torch import nn

from rollout_engine.models import batch_invariant, weight_writes
from rollout_engine.models.layers import Linear, linear, silu_mul
from rollout_engine.models.mlp import MLP
from rollout_engine.parallel.context import TPContext

KERNEL_MAX_TOKENS = 256
"""Batches up to this many tokens run their experts in the one-call kernel
(``kernels/cpu/moe_experts``); longer ones a product per expert."""


@dataclass(frozen=True)
class MoEArch:
    """The MoE facts of a Hugging Face config (``qwen3_moe`` / ``qwen2_moe``)."""

    num_experts: int
    top_k: int
    intermediate_size: int            # each expert's (moe_intermediate_size)
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]       # layer ids with experts; the others have a dense MLP
    shared_intermediate_size: int     # Qwen2-MoE's shared expert; 0: none

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Optional[MoEArch]:
        experts = int(cfg.get("num_experts") or 0)
        if not experts:
            return None
        top_k = int(cfg["num_experts_per_tok"])
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={experts}], "
                             f"got {top_k}")
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense and (i + 1) % step == 0)
        return cls(num_experts=experts, top_k=top_k,
                   intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   moe_layers=layers,
                   shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))

    def moe_index(self, layer_id: int) -> int:
        """The layer's position among the MoE layers (its column of a routing record)."""
        return self.moe_layers.index(layer_id)


def route(logits: torch.Tensor, top_k: int, norm: bool,
          chosen: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]`` int64) as the HF
    routers compute them: softmax in float32, top-k, optionally renormalised. ``chosen``
    replays given experts instead of the top-k (their probabilities are the gates)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if chosen is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = chosen.to(torch.int64)
        weights = probs.gather(1, ids)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _row_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` of the shared expert's ``[T, 1]`` gate. torch's elementwise loops take whole
    vectors and leave the remainder to scalar code whose ``exp`` rounds differently, so a row's
    value would follow its position in the batch; batch-invariant forwards use the kernel
    library's scalar sigmoid (every element by the same code)."""
    kernel = load_moe_experts() if batch_invariant.active() and g.is_cpu \
        and g.dtype is torch.float32 else None
    return torch.sigmoid(g) if kernel is None else kernel.sigmoid(g.contiguous())


class _ExpertViews:
    """Per-expert ``[2I, H]`` / ``[H, I]`` views of the stacked parameters, made again only
    when the weights are written (``weight_writes.generation``): the same view objects from
    one forward to the next, so `linear` keeps one packed copy per expert."""

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.w13: list[torch.Tensor] = []
        self.w2: list[torch.Tensor] = []

    def get(self, w13: torch.Tensor, w2: torch.Tensor, experts: int
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        key = (weight_writes.generation(), w13.data_ptr(), w2.data_ptr(), w13.dtype)
        if key != self.key:
            self.w13 = list(w13.detach().view(experts, -1, w13.shape[1]).unbind(0))
            self.w2 = list(w2.detach().view(experts, -1, w2.shape[1]).unbind(0))
            self.key = key
        return self.w13, self.w2


class SparseMoeBlock(nn.Module):
    """Router, stacked experts and (Qwen2-MoE) the gated shared expert of one layer. With
    ``tp`` each rank holds every expert's slice of the intermediate dimension (as the dense
    MLP) and the layer's partial sums are reduced once."""

    def __init__(self, hidden_size: int, moe: MoEArch, layer_id: int, bias: bool = False,
                 tp: Optional[TPContext] = None) -> None:
        super().__init__()
        self.moe, self.layer_id = moe, layer_id
        self.column = moe.moe_index(layer_id)
        self.group = None if tp is None else tp.group
        e, i = moe.num_experts, moe.intermediate_size
        if tp is not None:
            i = tp.split(i)[1]
        self.expert_size = i
        self.gate = Linear(hidden_size, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, hidden_size))
        self.w2 = nn.Parameter(torch.empty(e * hidden_size, i))
        self._views = _ExpertViews()
        self.shared: Optional[nn.Module] = None
        self.shared_gate: Optional[Linear] = None
        if moe.shared_intermediate_size:
            s = moe.shared_intermediate_size   # its partial sums are reduced with the experts'
            self.shared = MLP(hidden_size, s if tp is None else tp.split(s)[1], bias, tp,
                              reduce=False)
            self.shared_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, fb: Any = None) -> torch.Tensor:
        moe = self.moe
        replay = getattr(fb, "routing_in", None)
        chosen = None if replay is None else replay[:, self.column]
        weights, ids = route(self.gate(x), moe.top_k, moe.norm_topk_prob, chosen)
        record = getattr(fb, "routing_out", None)
        if record is not None:
            record[:, self.column].copy_(ids)
        out = self.experts(x, weights, ids)
        if self.shared is not None and self.shared_gate is not None:
            out = out + _row_sigmoid(self.shared_gate(x)) * self.shared(x)
        return out if self.group is None else self.group.all_reduce(out)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token, grouped by
        expert: one gate_up and one down product per expert in use."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts)
        token_of = order // k
        xs = x.index_select(0, token_of)
        kernel = self._kernel(x, t)
        if kernel is not None:   # every expert in one call
            e = self.moe.num_experts
            offsets = torch.zeros(e + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
            ys = kernel(xs, self.w13.detach().view(e, -1, x.shape[1]),
                        self.w2.detach().view(e, x.shape[1], -1), offsets)
        else:
            w13, w2 = self._views.get(self.w13, self.w2, self.moe.num_experts)
            ys = x.new_empty((t * k, x.shape[1]))
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    end = start + n
                    ys[start:end] = linear(silu_mul(linear(xs[start:end], w13[e])), w2[e])
                    start = end
        ys.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        return x.new_zeros(x.shape).index_add_(0, token_of, ys)

    def _kernel(self, x: torch.Tensor, tokens: int) -> Optional[MoeExperts]:
        """The one-call experts kernel where it applies: float32 CPU, no autograd, up to
        ``KERNEL_MAX_TOKENS`` tokens (a decode step; longer batches give each expert enough
        rows for a product of its own) or any number in batch-invariant forwards (its rows
        are invariant by construction; a row count threshold between two paths would not
        be)."""
        if (not x.is_cpu or x.dtype is not torch.float32 or self.w13.dtype is not torch.float32
                or (torch.is_grad_enabled() and self.w13.requires_grad)):
            return None
        if tokens > KERNEL_MAX_TOKENS and not batch_invariant.active():
            return None
        return load_moe_experts()

    def hf_names(self, pre: str) -> dict[str, tuple[nn.Parameter, int, int]]:
        """HF name -> (parameter, first row, rows) of the router, each expert and the shared
        expert (``pre``: ``model.layers.{i}.mlp.``)."""
        e, i, h = self.moe.num_experts, self.expert_size, self.w2.shape[0] // self.moe.num_experts
        table = {f"{pre}gate.weight": (self.gate.weight, 0, e)}
        for x in range(e):
            ex = f"{pre}experts.{x}."
            table[ex + "gate_proj.weight"] = (self.w13, 2 * i * x, i)
            table[ex + "up_proj.weight"] = (self.w13, 2 * i * x + i, i)
            table[ex + "down_proj.weight"] = (self.w2, h * x, h)
        if self.shared is not None and self.shared_gate is not None:
            table.update(self.shared.hf_names(f"{pre}shared_expert."))
            table[f"{pre}shared_expert_gate.weight"] = (self.shared_gate.weight, 0, 1)
        return table

    def stacked_names(self, pre: str) -> dict[str, tuple[nn.Parameter, tuple[int, ...],
                                                         tuple[str, ...]]]:
        """Transformers 5's names for the stacked experts -> (the parameter they fill whole,
        the shape they arrive in, the per-expert names they stand for)."""
        e, i = self.moe.num_experts, self.expert_size
        h = self.w2.shape[0] // e
        ex = [f"{pre}experts.{x}." for x in range(e)]
        return {f"{pre}experts.gate_up_proj": (
                    self.w13, (e, 2 * i, h),
                    tuple(n for p in ex for n in (p + "gate_proj.weight", p + "up_proj.weight"))),
                f"{pre}experts.down_proj": (
                    self.w2, (e, h, i), tuple(p + "down_proj.weight" for p in ex))}


def routing_bytes_per_token(moe: MoEArch) -> int:
    """Memory of one token's routing record (``moe_layers x top_k`` expert ids)."""
    return len(moe.moe_layers) * moe.top_k * routing_dtype(moe).itemsize


def routing_dtype(moe: MoEArch) -> torch.dtype:
    """The narrowest integer type that holds every expert id."""
    return torch.uint8 if moe.num_experts <= 256 else torch.int16 if moe.num_experts <= 32768 \
        else torch.int32
