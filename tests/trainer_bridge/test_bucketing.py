"""pack / unpack round trips bit-exactly; state_dict_items yields HF names, ties once."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from trainer_bridge.bucketing import bucket_layout, nbytes, pack, state_dict_items, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns, so equality below is bit equality."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool().view(shape)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3),
                                st.sampled_from(DTYPES)), min_size=1, max_size=12),
       bucket_bytes=st.integers(1, 400))
def test_pack_unpack_round_trip_is_bit_exact(specs, bucket_bytes):
    tensors = [(f"w{i}", _random(tuple(shape), dtype, i))
               for i, (shape, dtype) in enumerate(specs)]
    buckets = list(pack(iter(tensors), bucket_bytes))
    got = [pair for b in buckets for pair in unpack(b)]
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert _bits(have) == _bits(want)
    for b in buckets:  # a bucket overflows only when it holds a single oversized tensor
        assert b.buffer.numel() <= bucket_bytes or len(b.metas) == 1
        metas, total = bucket_layout([m.name for m in b.metas], [m.dtype for m in b.metas],
                                     [m.shape for m in b.metas])
        assert metas == b.metas and total == b.buffer.numel()  # what a broadcast receiver uses


def test_pack_copies_and_leaves_sources_alone():
    src = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # non-contiguous
    keep = src.clone()
    (bucket,) = pack([("a", src)], 1 << 20)
    bucket.buffer.zero_()
    assert torch.equal(src, keep)


def test_pack_rejects_a_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack([("a", torch.ones(2))], 0))


@pytest.fixture(scope="module")
def tied_model(w1_w2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(w1_w2[0], dtype=torch.float32)


def test_state_dict_items_are_the_checkpoint_names_with_ties_once(tied_model, w1_w2):
    assert tied_model.lm_head.weight is tied_model.model.embed_tokens.weight
    with safe_open(f"{w1_w2[0]}/model.safetensors", framework="pt") as f:
        checkpoint = {name: f.get_tensor(name) for name in f.keys()}
    items = list(state_dict_items(tied_model))
    names = [n for n, _ in items]
    assert "lm_head.weight" not in names and len(names) == len(set(names))
    assert set(names) == set(checkpoint) - {"lm_head.weight"}
    for name, t in items:
        assert not t.requires_grad and t.grad_fn is None
        assert torch.equal(t, checkpoint[name]), name
    # a state dict names the tied tensor twice; it still travels once
    from_state_dict = list(state_dict_items(tied_model.state_dict()))
    assert [n for n, _ in from_state_dict] == [n for n, _ in items]
    assert nbytes(items) == sum(t.numel() * t.element_size() for t in checkpoint.values()
                                ) - checkpoint["model.embed_tokens.weight"].nbytes * (
                                    "lm_head.weight" in checkpoint)


def test_state_dict_items_keeps_distinct_views_of_one_storage():
    base = torch.arange(8.0)
    items = list(state_dict_items([("a", base[:4]), ("b", base[4:]), ("a_again", base[:4])]))
    assert [n for n, _ in items] == ["a", "b"]
    with pytest.raises(ValueError, match="name, tensor"):
        list(state_dict_items([("a", [1.0])]))
