"""The shapes of real checkpoints, with random weights: what benchmarks and parity tests use
beside the 55M shape, so nothing is tuned on one toy shape only.

Each entry is the public ``config.json`` of the named checkpoint, as ``tiny_model_path``
arguments: head_dim 128 with 16 query heads over 8 KV heads (Qwen3-0.6B, wider attention
than its hidden size), GQA 7:1 (Qwen2.5-0.5B), llama3 RoPE scaling (Llama-3.2-1B), 128-152k
vocabularies and tied LM heads. The weights are seeded random (``tiny_model.init_weights``)
and the tokenizer the tiny one padded to the vocabulary, so token ids, not text, are the
workload. ``num_layers`` may be cut for tests: every layer has the same shape.

    from rollout_engine.testing.real_shapes import real_shape_path
    real_shape_path("qwen3-0.6b")                  # the full 28 layers (2.4 GB float32)
    real_shape_path("qwen3-0.6b", num_layers=2)    # its first two layers' shapes
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rollout_engine.testing.tiny_model import LLAMA3_ROPE_SCALING, tiny_model_path

REAL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                       max_position_embeddings=40960),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6,
                         max_position_embeddings=32768),
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_scaling={**LLAMA3_ROPE_SCALING, "factor": 32.0,
                                       "original_max_position_embeddings": 8192}),
}


def real_shape_path(name: str, num_layers: Optional[int] = None) -> Path:
    """A cached model directory of ``name``'s shape (``REAL_SHAPES``), random weights."""
    if name not in REAL_SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {sorted(REAL_SHAPES)}")
    kwargs = dict(REAL_SHAPES[name])
    if num_layers is not None:
        kwargs["num_layers"] = num_layers
    return tiny_model_path(**kwargs)
