"""A readable Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3) over the paged KV pool.

Tokens of all requests in a batch are flattened to ``[T, hidden]``; attention is delegated to the
backend in ``ForwardBatch`` which writes this step's K/V into the pool and attends over each
request's slots. Projections are fused (qkv, gate_up); ``weight_map`` says where every Hugging
Face parameter name lands so loading and refitting use the same table.

With tensor parallelism (``tp``, rollout_engine/parallel) a rank builds only its part: its q and
KV heads in ``qkv_proj``, its rows of ``gate_up_proj`` and of the vocabulary, its columns of
``o_proj`` / ``down_proj`` (row-parallel: summed over the ranks); ``tp_shards`` says which slice
of each full checkpoint tensor that is. Without ``tp`` the modules are exactly the plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from rollout_engine.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    linear_fp32_out,
)
from rollout_engine.models.mlp import MLP
from rollout_engine.models.moe import MoEArch, SparseMoeBlock
from rollout_engine.models.quant_linear import make_linear, make_merged
from rollout_engine.models.tp_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from rollout_engine.parallel.context import Shard, TPContext
from rollout_engine.quantization.convert import NoQuantizer, create_quantizer


@dataclass(frozen=True)
class ModelArch:
    """The shape facts the engine needs, read from a Hugging Face ``config.json``."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: Optional[MoEArch] = None   # Qwen3-MoE / Qwen2-MoE: experts in moe.moe_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = dict(cfg.get("rope_parameters") or {})
        if cfg.get("rope_scaling"):
            rope.update(cfg["rope_scaling"])
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (silu)")
        is_qwen2 = model_type in ("qwen2", "qwen2_moe")
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=MoEArch.from_hf_config(cfg),
        )


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_id: int, tp: Optional[TPContext] = None,
                 quant: Optional[str] = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        if tp is not None:   # this rank's heads
            self.num_heads = tp.split(arch.num_heads)[1]
            self.num_kv_heads = tp.kv_heads(arch.num_heads, arch.num_kv_heads)[1]
        q, kv = self.num_heads * arch.head_dim, self.num_kv_heads * arch.head_dim
        self.qkv_proj = make_merged(arch.hidden_size, [q, kv, kv], arch.qkv_bias, quant)
        self.o_proj: nn.Module = (make_linear(q, arch.hidden_size, arch.o_bias, quant)
                                  if tp is None
                                  else RowParallelLinear(q, arch.hidden_size, arch.o_bias, tp))
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scaling = arch.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: Any) -> torch.Tensor:
        t, lora = h.shape[0], fb.lora   # LoraBatch: adapters' updates (models/lora.py)
        qkv = self.qkv_proj(h)
        if lora is not None:
            lora.apply(self.layer_id, "qkv_proj", h, qkv)
        q, k, v = qkv.split_with_sizes(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply_qk(q, k, cos, sin)
        o = fb.attn_backend.forward(q, k, v, self.layer_id, self.scaling, fb).reshape(t, -1)
        out = self.o_proj(o)
        if lora is not None:
            lora.apply(self.layer_id, "o_proj", o, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_id: int, tp: Optional[TPContext] = None,
                 quant: Optional[str] = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_id, tp, quant)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: nn.Module
        if arch.moe is not None and layer_id in arch.moe.moe_layers:
            self.mlp = SparseMoeBlock(arch.hidden_size, arch.moe, layer_id, arch.mlp_bias, tp)
        else:
            i = arch.intermediate_size
            self.mlp = MLP(arch.hidden_size, i if tp is None else tp.split(i)[1],
                           arch.mlp_bias, tp, layer_id=layer_id, quant=quant)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately (as vLLM does) so that each residual add
        fuses with the norm after it: ``x`` is the previous sublayer's output (the embedding
        for the first layer, ``residual`` None), and the layer returns its MLP output and the
        stream before it; the stream after layer i is ``residual + x``, exactly as HF's
        ``x = x + sublayer(norm(x))``."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, fb)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, fb), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; also serves Qwen2 (qkv bias), Qwen3 (q/k norm) and their
    mixture-of-experts variants (``models/moe.py``). ``quant``: the quantization method of
    the decoder layers' linears (``rollout_engine/quantization``; embeddings, norms and the LM
    head stay in the model's dtype); ``self.quant`` converts what loads and refits write."""

    def __init__(self, arch: ModelArch, tp: Optional[TPContext] = None,
                 quant: Optional[str] = None) -> None:
        super().__init__()
        if quant is not None and (arch.moe is not None or tp is not None):
            raise ValueError(f"quantization {quant!r} is not implemented for "
                             + ("mixture-of-experts models" if arch.moe is not None
                                else "tensor parallelism"))
        self.arch = arch
        self.tp = tp
        self._tp_shards: Optional[dict[str, Shard]] = None
        vocab_rows = arch.vocab_size   # this rank's, padded, with tp
        if tp is None:
            self.embed_tokens: nn.Module = Embedding(arch.vocab_size, arch.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
            vocab_rows = tp.vocab(arch.vocab_size)[2]
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp, quant)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.lm_head = (None if arch.tie_word_embeddings
                        else Linear(arch.hidden_size, vocab_rows, bias=False))
        self.quant: NoQuantizer = create_quantizer(quant, self.quantized_weight_names())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, fb)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (computed from 16-bit weights without a 16-bit rounding). With tp,
        the whole vocabulary's on rank 0 and None on the others."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp is not None:
            return vocab_parallel_logits(hidden, weight, self.tp, self.arch.vocab_size)
        return linear_fp32_out(hidden, weight)

    # -- weights ------------------------------------------------------------------------------
    def weight_map(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """HF name -> (parameter, first row, number of rows) for every loadable tensor."""
        table: dict[str, tuple[nn.Parameter, int, int]] = {}

        def whole(name: str, p: nn.Parameter) -> None:
            table[name] = (p, 0, p.shape[0] if p.dim() else 0)

        # with tp the vocabulary's rows end before the padding
        vocab_rows = self.arch.vocab_size if self.tp is None else self.tp.vocab(
            self.arch.vocab_size)[1]
        table["model.embed_tokens.weight"] = (self.embed_tokens.weight, 0, vocab_rows)
        whole("model.norm.weight", self.norm.weight)
        if self.lm_head is not None:
            table["lm_head.weight"] = (self.lm_head.weight, 0, vocab_rows)
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for kind in ("weight", "bias", "weight_scale"):
                fused = getattr(attn.qkv_proj, kind, None)
                if fused is not None:
                    for shard, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                        table[f"{pre}self_attn.{proj}.{kind}"] = (
                            fused, attn.qkv_proj.shard_offset(shard), attn.qkv_proj.shard_sizes[shard])
                p = getattr(attn.o_proj, kind, None)
                if p is not None:
                    whole(f"{pre}self_attn.o_proj.{kind}", p)
            table.update(mlp.hf_names(f"{pre}mlp."))
            whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            if attn.q_norm is not None and attn.k_norm is not None:
                whole(f"{pre}self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{pre}self_attn.k_norm.weight", attn.k_norm.weight)
        return table

    def quantized_weight_names(self) -> list[str]:
        """The HF weight names of the decoder layers' linears (what ``--quantization``
        quantizes), whatever the method."""
        return [f"model.layers.{i}.{proj}.weight" for i in range(self.arch.num_layers)
                for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                             "mlp.down_proj")]

    def tp_shards(self) -> dict[str, Shard]:
        """HF name -> the slice of the full checkpoint tensor this rank holds, for every
        sharded weight (none without tp; norms and row-parallel biases are whole). Fixed by
        the shapes: built once."""
        if self._tp_shards is None:
            self._tp_shards = self._build_tp_shards()
        return self._tp_shards

    def _build_tp_shards(self) -> dict[str, Shard]:
        tp, a = self.tp, self.arch
        if tp is None:
            return {}
        d, h, i_full = a.head_dim, a.hidden_size, a.intermediate_size
        q0, qn = tp.split(a.num_heads)
        k0, kn = tp.kv_heads(a.num_heads, a.num_kv_heads)
        v0, vn, _ = tp.vocab(a.vocab_size)
        shards = {"model.embed_tokens.weight": Shard(0, v0, vn, (a.vocab_size, h))}
        if self.lm_head is not None:
            shards["lm_head.weight"] = Shard(0, v0, vn, (a.vocab_size, h))
        kinds = [("weight", (h,))] + ([("bias", ())] if a.qkv_bias else [])
        mlp_kinds = [("weight", (h,))] + ([("bias", ())] if a.mlp_bias else [])
        for layer in range(a.num_layers):
            pre = f"model.layers.{layer}."
            for kind, rest in kinds:
                shards[f"{pre}self_attn.q_proj.{kind}"] = Shard(0, q0 * d, qn * d,
                                                                (a.num_heads * d, *rest))
                for proj in ("k_proj", "v_proj"):
                    shards[f"{pre}self_attn.{proj}.{kind}"] = Shard(
                        0, k0 * d, kn * d, (a.num_kv_heads * d, *rest))
            shards[f"{pre}self_attn.o_proj.weight"] = Shard(1, q0 * d, qn * d,
                                                            (h, a.num_heads * d))
            if a.moe is None or layer not in a.moe.moe_layers:
                mlps = [(f"{pre}mlp.", i_full, mlp_kinds)]
            else:   # every expert (and the shared one) split like the dense MLP
                mlps = [(f"{pre}mlp.experts.{e}.", a.moe.intermediate_size, [("weight", (h,))])
                        for e in range(a.moe.num_experts)]
                if a.moe.shared_intermediate_size:
                    mlps.append((f"{pre}mlp.shared_expert.", a.moe.shared_intermediate_size,
                                 mlp_kinds))
            for mlp, full, these in mlps:
                i0, i_n = tp.split(full)
                for kind, rest in these:
                    for proj in ("gate_proj", "up_proj"):
                        shards[f"{mlp}{proj}.{kind}"] = Shard(0, i0, i_n, (full, *rest))
                shards[f"{mlp}down_proj.weight"] = Shard(1, i0, i_n, (h, full))
        return shards

    def stacked_names(self) -> dict[str, tuple[nn.Parameter, tuple[int, ...], tuple[str, ...]]]:
        """HF names whose tensors fill a whole stacked parameter, in another shape
        (transformers 5's expert tensors): name -> (parameter, incoming shape, the
        ``weight_map`` names it stands for). None with tp (the per-expert names shard)."""
        if self.tp is not None:
            return {}
        names: dict[str, tuple[nn.Parameter, tuple[int, ...], tuple[str, ...]]] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                names.update(layer.mlp.stacked_names(f"model.layers.{i}.mlp."))
        return names

    @staticmethod
    def ignored_weight(name: str) -> bool:
        """Checkpoint entries that carry no parameter of ours."""
        return name.endswith("rotary_emb.inv_freq")
