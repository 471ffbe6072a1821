"""Deterministic random-weight mixture-of-experts models (Qwen3-MoE, Qwen2-MoE) for tests and
benchmarks: the dense generator's attention, norms and tokenizer (``tiny_model``) with the MLP of
every MoE layer replaced by a router and experts, saved under the Hugging Face per-expert names
(``mlp.experts.{e}.gate_proj.weight`` ...) as hub checkpoints are.

    python -m rollout_engine.testing.tiny_moe OUT --family qwen3_moe --num-experts 16 --top-k 4
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from rollout_engine.testing import tiny_model
from rollout_engine.testing._corpus import tokenizer_files

FAMILIES = {   # family -> (dense arch for attention, config class, architecture)
    "qwen3_moe": ("qwen3", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2", "Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}
ROUTER_STD = 1.0   # router logits of O(1) per unit of normalised input: decisive top-k choices

# Qwen3-30B-A3B's ratios (hidden 2048, 128 experts, top-8, expert width 768) scaled down.
PRESET_30B_A3B_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                            head_dim=64, intermediate_size=1536, vocab_size=32000,
                            num_experts=128, top_k=8, moe_intermediate_size=192)


@dataclass(frozen=True)
class MoESpec:
    """The expert-side arguments (the dense ones are ``tiny_model.TinyModelSpec``'s)."""

    family: str = "qwen3_moe"
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's shared expert; 0: none

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def hf_config(dense: tiny_model.TinyModelSpec, moe: MoESpec) -> dict[str, Any]:
    """config.json: the dense generator's, re-typed as the MoE family's with its fields."""
    import transformers

    _, config_name, architecture = FAMILIES[moe.family]
    base = tiny_model.hf_config(dense)
    fields = dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                  moe_intermediate_size=moe.moe_intermediate_size,
                  norm_topk_prob=moe.norm_topk_prob,
                  decoder_sparse_step=moe.decoder_sparse_step,
                  mlp_only_layers=list(moe.mlp_only_layers))
    if moe.family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    keep = {k: v for k, v in base.items()
            if k not in ("architectures", "model_type", "transformers_version")}
    config = getattr(transformers, config_name)(**{**keep, **fields}).to_diff_dict()
    config.update(fields)
    for k in ("rope_theta", "rope_scaling", "torch_dtype"):
        config[k] = base[k]
    config["architectures"] = [architecture]
    return config


def init_weights(dense: tiny_model.TinyModelSpec, moe: MoESpec) -> dict[str, torch.Tensor]:
    """The dense generator's weights with each MoE layer's MLP swapped for a router, experts
    and (Qwen2-MoE) a gated shared expert, drawn from a second generator seeded alike."""
    weights = tiny_model.init_weights(dense)
    gen = torch.Generator().manual_seed(10_000 + dense.seed)
    h, i = dense.hidden_size, moe.moe_intermediate_size

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * (gain / math.sqrt(in_features))

    for layer in range(dense.num_layers):
        if not moe.is_moe_layer(layer):
            continue
        p = f"model.layers.{layer}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del weights[p + proj + ".weight"]
        weights[p + "gate.weight"] = linear(moe.num_experts, h, ROUTER_STD * math.sqrt(h))
        for e in range(moe.num_experts):
            weights[f"{p}experts.{e}.gate_proj.weight"] = linear(i, h)
            weights[f"{p}experts.{e}.up_proj.weight"] = linear(i, h)
            weights[f"{p}experts.{e}.down_proj.weight"] = linear(h, i, tiny_model.RESIDUAL_GAIN)
        s = moe.shared_expert_intermediate_size
        if s:
            weights[p + "shared_expert.gate_proj.weight"] = linear(s, h)
            weights[p + "shared_expert.up_proj.weight"] = linear(s, h)
            weights[p + "shared_expert.down_proj.weight"] = linear(h, s, tiny_model.RESIDUAL_GAIN)
            weights[p + "shared_expert_gate.weight"] = linear(1, h)
    return weights


def make_tiny_moe(out_dir: str | Path, family: str = "qwen3_moe", *, seed: int = 0,
                  **kwargs: Any) -> Path:
    """Write a random-weight MoE model directory (new or empty) and return its path. Keyword
    arguments: ``MoESpec``'s fields and ``tiny_model.TinyModelSpec``'s sizes."""
    dense, moe = _specs(family, seed, kwargs)
    return _write(dense, moe, Path(out_dir))


def tiny_moe_path(family: str = "qwen3_moe", **kwargs: Any) -> Path:
    """A cached `make_tiny_moe` directory (keyed by the arguments and this generator's source),
    built once; safe under concurrent builders."""
    dense, moe = _specs(family, kwargs.pop("seed", 0), kwargs)
    digest = hashlib.sha256()
    here = Path(__file__)
    for source in (here, here.with_name("tiny_model.py"), here.with_name("_corpus.py")):
        digest.update(source.read_bytes())
    key = json.dumps({"dense": dataclasses.asdict(dense), "moe": dataclasses.asdict(moe),
                      "source": digest.hexdigest(), "transformers": version("transformers")},
                     sort_keys=True)
    return tiny_model.cached_build(
        f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:16]}",
        lambda tmp: _write(dense, moe, tmp))


def _specs(family: str, seed: int, kwargs: dict[str, Any]
           ) -> tuple[tiny_model.TinyModelSpec, MoESpec]:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    moe_fields = {f.name for f in dataclasses.fields(MoESpec)} - {"family"}
    moe_args = {k: kwargs.pop(k) for k in list(kwargs) if k in moe_fields}
    if "top_k" not in moe_args and "num_experts_per_tok" in kwargs:
        moe_args["top_k"] = kwargs.pop("num_experts_per_tok")
    if family == "qwen2_moe":
        moe_args.setdefault("shared_expert_intermediate_size", 96)
        moe_args.setdefault("norm_topk_prob", False)
    dense = tiny_model.TinyModelSpec(arch=FAMILIES[family][0], seed=seed, **kwargs)
    return dense, MoESpec(family=family, **moe_args)


def _write(dense: tiny_model.TinyModelSpec, moe: MoESpec, out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; pass a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json = tiny_model._write_json
    write_json(out_dir / "config.json", hf_config(dense, moe))
    tiny_model.save_weights(init_weights(dense, moe), out_dir, dense.shard_size_mb)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": tiny_model.BOS_TOKEN_ID, "eos_token_id": tiny_model.EOS_TOKEN_ID,
                "pad_token_id": tiny_model.PAD_TOKEN_ID,
                "transformers_version": version("transformers")})
    for name, text in tokenizer_files(dense.vocab_size, dense.max_position_embeddings).items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--preset-30b-a3b-shape", action="store_true",
                        help=f"sizes: {PRESET_30B_A3B_SHAPE}")
    for name in ("seed", "num_experts", "top_k", "moe_intermediate_size", "hidden_size",
                 "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    args = parser.parse_args(argv)
    kwargs = dict(PRESET_30B_A3B_SHAPE) if args.preset_30b_a3b_shape else {}
    kwargs.update({k: v for k, v in vars(args).items()
                   if v is not None and k not in ("out_dir", "family", "preset_30b_a3b_shape")})
    print(make_tiny_moe(args.out_dir, args.family, **kwargs))


if __name__ == "__main__":
    main()
