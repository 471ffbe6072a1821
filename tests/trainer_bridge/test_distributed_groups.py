"""How a bucketed broadcast splits a model into calls (`bucket_runs.bucket_runs`): every tensor
once, in order, no call over the bucket unless one tensor alone is, and a module's projections
(the parts an engine fuses: q / k / v, gate / up) kept in one call whenever they fit one."""

from __future__ import annotations

import torch

from trainer_bridge.transports.bucket_runs import bucket_runs, module_of


def _layer(i: int) -> list[tuple[str, torch.Tensor]]:
    """A Qwen2 layer's weights in Hugging Face's order, sizes in float32 elements."""
    p = f"model.layers.{i}"
    sizes = [("self_attn.q_proj.weight", 64), ("self_attn.q_proj.bias", 8),
             ("self_attn.k_proj.weight", 16), ("self_attn.k_proj.bias", 2),
             ("self_attn.v_proj.weight", 16), ("self_attn.v_proj.bias", 2),
             ("self_attn.o_proj.weight", 64), ("mlp.gate_proj.weight", 128),
             ("mlp.up_proj.weight", 128), ("mlp.down_proj.weight", 128),
             ("input_layernorm.weight", 8), ("post_attention_layernorm.weight", 8)]
    return [(f"{p}.{n}", torch.zeros(k)) for n, k in sizes]


def _model() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.zeros(512)),
            *(t for i in range(3) for t in _layer(i)),
            ("model.norm.weight", torch.zeros(8)), ("lm_head.weight", torch.zeros(512))]


def _bytes(group: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * 4 for _, t in group)


def test_groups_keep_every_tensor_in_order_within_the_bucket():
    tensors = _model()
    for bucket in (64, 300, 700, 1000, 1500, 4096, 1 << 20):
        groups = bucket_runs(tensors, bucket)
        assert [n for g in groups for n, _ in g] == [n for n, _ in tensors], bucket
        assert all(g for g in groups)
        assert all(_bytes(g) <= bucket or len(g) == 1 for g in groups), bucket


def test_a_module_that_fits_a_call_is_never_split():
    """Bucket 700 B: filling calls greedily would cut layer 0's attention after q's weight; the
    self_attn module (688 B) and the mlp module (1,536 B, over the bucket: cut anyway) of
    each layer land in calls of their own."""
    tensors = _model()
    for bucket in (700, 1000, 1500, 2800):
        groups = bucket_runs(tensors, bucket)
        where = {n: i for i, g in enumerate(groups) for n, _ in g}
        for i in range(3):
            attn = [n for n, _ in tensors if n.startswith(f"model.layers.{i}.self_attn.")]
            assert len({where[n] for n in attn}) == 1, (bucket, i)
            mlp = [n for n, _ in tensors if n.startswith(f"model.layers.{i}.mlp.")]
            if sum(t.numel() * 4 for n, t in tensors if n in mlp) <= bucket:
                assert len({where[n] for n in mlp}) == 1, (bucket, i)
    # a greedy fill would have split q from k / v at 700 B: the rule is what keeps them
    assert module_of("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn"
