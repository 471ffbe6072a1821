"""Deterministic random-weight Hugging Face models (Qwen2, Qwen3, Llama) for tests and benchmarks.

`make_tiny_model(dir)` writes a directory that `transformers` loads like a hub checkpoint: config,
safetensors weights (optionally sharded), generation config and a byte-level BPE tokenizer trained
on a built-in corpus. `tiny_model_path()` builds once into a cache and returns the directory.

    python -m rollout_engine.testing.tiny_model OUT --arch qwen3 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rollout_engine.testing._corpus import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    tokenizer_files,
)

__all__ = [
    "ARCHS",
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "IM_END_TOKEN_ID",
    "IM_START_TOKEN_ID",
    "LLAMA3_ROPE_SCALING",
    "PAD_TOKEN_ID",
    "PRESET_55M",
    "TinyModelSpec",
    "make_tiny_model",
    "tiny_model_path",
]

ARCHS = ("qwen2", "qwen3", "llama")
# ~55M parameters untied (llama default), ~39M tied.
PRESET_55M = dict(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1408,
    vocab_size=32000,
)
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # specials plus every byte, so any text encodes
ROPE_THETA = 10000.0
# A small original length so the llama3 frequency scaling changes outputs at test lengths.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
_HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
RESIDUAL_GAIN = 6.0  # see init_weights
DEFAULT_LOGIT_STD = 4.0  # big enough that greedy top-1/top-2 gaps dwarf float noise
_INT_ARGS = (
    "seed",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Every argument that determines the bytes of a tiny model directory."""

    arch: str = "qwen2"
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool | None = None  # None: tied for qwen2/qwen3, untied for llama
    rope_scaling: dict | None = None
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = ROPE_THETA
    rms_norm_eps: float = 1e-6
    shard_size_mb: float | None = None
    init_std: float | None = None  # embedding/lm_head std; None: DEFAULT_LOGIT_STD / sqrt(hidden)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {self.vocab_size}")
        if self.shard_size_mb is not None and self.shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be positive, got {self.shard_size_mb}")
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if self.tie_word_embeddings is None:
            object.__setattr__(self, "tie_word_embeddings", self.arch != "llama")
        if self.init_std is None:
            object.__setattr__(self, "init_std", DEFAULT_LOGIT_STD / math.sqrt(self.hidden_size))

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim


def hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The config.json dict: what transformers writes, plus the hub-style legacy rope keys."""
    import transformers  # here, not at the top: a cache hit should not pay for this import

    config_cls = getattr(transformers, _HF_CLASSES[spec.arch][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            **(spec.rope_scaling or {}),
            "rope_theta": spec.rope_theta,
        },
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        rms_norm_eps=spec.rms_norm_eps,
        dtype="float32",
    )
    if spec.arch != "qwen2" or spec.head_dim != spec.hidden_size // spec.num_heads:
        kwargs["head_dim"] = spec.head_dim
    config = config_cls(**kwargs).to_diff_dict()
    config["architectures"] = [_HF_CLASSES[spec.arch][1]]
    # Hub checkpoints (and loaders written against them) use these pre-v5 names.
    config["rope_theta"] = spec.rope_theta
    config["rope_scaling"] = dict(spec.rope_scaling) if spec.rope_scaling else None
    config["torch_dtype"] = "float32"
    return config


def init_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Random float32 weights under Hugging Face names, drawn from one seeded generator.

    The default init (std 0.02) gives near-uniform logits whose greedy argmax flips under float
    noise. Here embeddings/lm_head have std `init_std` (logit std ~ init_std * sqrt(hidden_size)),
    inputs to q/k/v/gate/up see 1/sqrt(fan_in) weights so attention and gating stay O(1), and the
    residual writers (o_proj, down_proj) get RESIDUAL_GAIN: with tied embeddings, a residual stream
    dominated by the token's own embedding makes each token predict itself, and greedy decoding
    repeats one token forever. Norm weights and biases are non-trivial so every parameter matters.
    """
    gen = torch.Generator().manual_seed(spec.seed)
    h, kv, inter = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    q = spec.q_width

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std + mean

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal(out_features, in_features, std=gain / math.sqrt(in_features))

    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h, std=spec.init_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = normal(h, std=0.1, mean=1.0)
        weights[p + "self_attn.q_proj.weight"] = linear(q, h)
        weights[p + "self_attn.k_proj.weight"] = linear(kv, h)
        weights[p + "self_attn.v_proj.weight"] = linear(kv, h)
        if spec.arch == "qwen2":
            weights[p + "self_attn.q_proj.bias"] = normal(q, std=0.2)
            weights[p + "self_attn.k_proj.bias"] = normal(kv, std=0.2)
            weights[p + "self_attn.v_proj.bias"] = normal(kv, std=0.2)
        if spec.arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = normal(spec.head_dim, std=0.1, mean=1.0)
            weights[p + "self_attn.k_norm.weight"] = normal(spec.head_dim, std=0.1, mean=1.0)
        weights[p + "self_attn.o_proj.weight"] = linear(h, q, RESIDUAL_GAIN)
        weights[p + "post_attention_layernorm.weight"] = normal(h, std=0.1, mean=1.0)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, h)
        weights[p + "mlp.up_proj.weight"] = linear(inter, h)
        weights[p + "mlp.down_proj.weight"] = linear(h, inter, RESIDUAL_GAIN)
    weights["model.norm.weight"] = normal(h, std=0.1, mean=1.0)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h, std=spec.init_std)
    return weights


def save_weights(
    weights: dict[str, torch.Tensor], out_dir: Path, shard_size_mb: float | None
) -> list[str]:
    """Write safetensors, sharded in insertion order when `shard_size_mb` is given; return names."""
    metadata = {"format": "pt"}
    if shard_size_mb is None:
        save_file(weights, str(out_dir / "model.safetensors"), metadata=metadata)
        return ["model.safetensors"]
    limit = shard_size_mb * 2**20
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > limit:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(file_names, shards):
        save_file(shard, str(out_dir / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)
    return file_names


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict | None = None,
    shard_size_mb: float | None = None,
    init_std: float | None = None,
    head_dim: int | None = None,
    rope_theta: float = ROPE_THETA,
    rms_norm_eps: float = 1e-6,
) -> Path:
    """Write a random-weight model directory to `out_dir` (new or empty) and return its path.

    Same arguments, same bytes: weights come from `torch.Generator().manual_seed(seed)` and the
    tokenizer from a fixed corpus (it depends only on `vocab_size`).
    """
    spec = TinyModelSpec(
        arch=arch,
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        shard_size_mb=shard_size_mb,
        init_std=init_std,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
    )
    return _write_model(spec, Path(out_dir))


def _write_model(spec: TinyModelSpec, out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; pass a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", hf_config(spec))
    save_weights(init_weights(spec), out_dir, spec.shard_size_mb)
    special_ids = dict(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    generation_config = {**special_ids, "transformers_version": version("transformers")}
    _write_json(out_dir / "generation_config.json", generation_config)

    for name, text in tokenizer_files(spec.vocab_size, spec.max_position_embeddings).items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return out_dir


def cache_root() -> Path:
    """Where `tiny_model_path` builds: $ROLLOUT_ENGINE_CACHE/tiny_models, else ~/.cache/..."""
    root = os.environ.get("ROLLOUT_ENGINE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "rollout_engine"
    return base / "tiny_models"


def tiny_model_path(arch: str = "qwen2", **kwargs: Any) -> Path:
    """Return a cached `make_tiny_model(dir, arch, **kwargs)` directory, building it if missing.

    Keyed by the resolved arguments and a hash of this generator's source, so editing the generator
    invalidates old builds. Safe under concurrent builders: each builds in a private temp dir and
    renames it into place; a loser of the race discards its copy.
    """
    spec = TinyModelSpec(arch=arch, **kwargs)
    fingerprint = hashlib.sha256()
    for source in (Path(__file__), Path(__file__).with_name("_corpus.py")):
        fingerprint.update(source.read_bytes())
    key = json.dumps(
        {
            "spec": dataclasses.asdict(spec),
            "source": fingerprint.hexdigest(),
            "transformers": version("transformers"),
        },
        sort_keys=True,
    )
    return cached_build(f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:16]}",
                        lambda tmp: _write_model(spec, tmp))


def cached_build(name: str, write: Callable[[Path], Any]) -> Path:
    """``cache_root() / name``, made by ``write(empty temp dir)`` if missing: each builder
    writes a private directory and renames it into place; a loser of the race discards its
    copy."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():  # a real failure, not a lost race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """CLI: write a tiny model directory and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    defaults = TinyModelSpec()
    for name in _INT_ARGS:
        parser.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(defaults, name)
        )
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        help="default: tied for qwen2/qwen3, untied for llama",
    )
    parser.add_argument("--rope-scaling-llama3", action="store_true", help=str(LLAMA3_ROPE_SCALING))
    parser.add_argument("--shard-size-mb", type=float)
    parser.add_argument("--init-std", type=float, help="default: 4 / sqrt(hidden_size)")
    parser.add_argument("--preset-55m", action="store_true", help=f"override sizes: {PRESET_55M}")
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, name) for name in _INT_ARGS}
    if args.preset_55m:
        sizes.update(PRESET_55M)
    try:
        out = make_tiny_model(
            args.out_dir,
            args.arch,
            tie_word_embeddings=args.tie_word_embeddings,
            rope_scaling=dict(LLAMA3_ROPE_SCALING) if args.rope_scaling_llama3 else None,
            shard_size_mb=args.shard_size_mb,
            init_std=args.init_std,
            **sizes,
        )
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    print(out)


if __name__ == "__main__":
    main()
