import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.protocol.bucket import (
    ALIGN_BYTES,
    SUPPORTED_DTYPES,
    FlattenedBucket,
    TensorMeta,
    dtype_to_str,
    pack_buckets,
    str_to_dtype,
)


def _random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (not just random values) so the round trip is checked bit-exactly."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool().view(shape)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _unpack_all(buckets) -> list[tuple[str, torch.Tensor]]:
    return [pair for bucket in buckets for pair in bucket.named_tensors()]


def _assert_same(expected, actual) -> None:
    assert [n for n, _ in expected] == [n for n, _ in actual]
    for (name, want), (_, got) in zip(expected, actual, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(_bits(got), _bits(want)), name


MIXED = [
    ("f32", _random_tensor((3, 5), torch.float32, 0)),
    ("bf16", _random_tensor((7,), torch.bfloat16, 1)),
    ("f16", _random_tensor((2, 2, 3), torch.float16, 2)),
    ("i64", _random_tensor((4,), torch.int64, 3)),
    ("mask", _random_tensor((9,), torch.bool, 4)),
    ("scalar", torch.tensor(-2.5, dtype=torch.float64)),
    ("empty", torch.zeros(0, 3, dtype=torch.float32)),
    ("u8", _random_tensor((5,), torch.uint8, 5)),
    ("c64", _random_tensor((2,), torch.complex64, 6)),
]


@pytest.mark.parametrize("bucket_bytes", [1, 40, 64, 100, 1 << 20])
def test_round_trip_mixed_dtypes(bucket_bytes):
    buckets = list(pack_buckets(MIXED, bucket_bytes))
    _assert_same(MIXED, _unpack_all(buckets))
    for bucket in buckets:
        assert bucket.buffer.numel() <= bucket_bytes or len(bucket.metas) == 1
        assert all(m.offset % ALIGN_BYTES == 0 for m in bucket.metas)


def test_greedy_packing_counts():
    tensors = [(f"t{i}", torch.ones(4)) for i in range(5)]  # 16 bytes each, 16-aligned
    assert [len(b.metas) for b in pack_buckets(tensors, 48)] == [3, 2]
    assert [len(b.metas) for b in pack_buckets(tensors, 15)] == [1] * 5
    assert [len(b.metas) for b in pack_buckets(tensors, 1 << 10)] == [5]
    big = [("small", torch.ones(1)), ("big", torch.ones(100)), ("small2", torch.ones(1))]
    assert [[m.name for m in b.metas] for b in pack_buckets(big, 64)] == [
        ["small"],
        ["big"],
        ["small2"],
    ]
    assert list(pack_buckets([], 64)) == []


def test_padding_and_offsets():
    tensors = [("a", torch.ones(3)), ("b", torch.ones(1, dtype=torch.int8)), ("c", torch.ones(2))]
    (bucket,) = pack_buckets(tensors, 1024)
    assert [(m.offset, m.nbytes) for m in bucket.metas] == [(0, 12), (16, 1), (32, 8)]
    assert bucket.buffer.numel() == 40


def test_empty_and_zero_dim_tensors():
    tensors = [
        ("e0", torch.zeros(0)),
        ("s", torch.tensor(7, dtype=torch.int64)),
        ("e1", torch.zeros(2, 0, dtype=torch.bfloat16)),
        ("b", torch.tensor(True)),
    ]
    for bucket_bytes in (1, 1024):
        _assert_same(tensors, _unpack_all(pack_buckets(tensors, bucket_bytes)))
    (bucket,) = pack_buckets([("only_empty", torch.zeros(0))], 16)
    assert bucket.buffer.numel() == 0 and bucket.named_tensors()[0][1].shape == (0,)


def test_non_contiguous_inputs():
    base = _random_tensor((6, 8), torch.float32, 7)
    tensors = [
        ("transposed", base.t()),
        ("strided", base[:, ::3]),
        ("expanded", torch.arange(3.0).expand(4, 3)),
        ("bf16_t", _random_tensor((4, 6), torch.bfloat16, 8).t()),
    ]
    assert not any(t.is_contiguous() for _, t in tensors)
    _assert_same(tensors, _unpack_all(pack_buckets(tensors, 1 << 12)))


def test_views_are_zero_copy():
    (bucket,) = pack_buckets([("a", torch.zeros(4)), ("b", torch.zeros(2, 2))], 1024)
    (_, a), (_, b) = bucket.named_tensors()
    bucket.buffer[16:20].copy_(torch.tensor([1.5]).view(torch.uint8))
    assert b[0, 0].item() == 1.5
    a.fill_(2.0)
    assert torch.equal(bucket.buffer[:16].view(torch.float32), torch.full((4,), 2.0))
    assert a.data_ptr() == bucket.buffer.data_ptr()


def test_requires_grad_source_gives_plain_buffer():
    param = torch.nn.Parameter(torch.randn(3))
    (bucket,) = pack_buckets([("p", param)], 64)
    assert not bucket.buffer.requires_grad
    assert torch.equal(bucket.named_tensors()[0][1], param.detach())


def test_device_change_starts_new_bucket():
    tensors = [("cpu", torch.ones(2)), ("meta", torch.ones(2, device="meta"))]
    buckets = list(pack_buckets(tensors, 1024))
    assert [b.buffer.device.type for b in buckets] == ["cpu", "meta"]


def test_pack_is_lazy():
    consumed = []

    def source():
        for i in range(6):
            consumed.append(i)
            yield f"t{i}", torch.ones(4)

    gen = pack_buckets(source(), 32)
    first = next(gen)
    assert [m.name for m in first.metas] == ["t0", "t1"] and len(consumed) == 3


def test_truncated_bucket_raises():
    (bucket,) = pack_buckets(MIXED[:3], 1 << 20)
    last = bucket.metas[-1].name
    with pytest.raises(ValueError, match=f"truncated bucket: tensor '{last}'"):
        FlattenedBucket(bucket.buffer[:-1].clone(), bucket.metas)
    with pytest.raises(ValueError, match="truncated bucket"):
        FlattenedBucket(torch.empty(0, dtype=torch.uint8), bucket.metas)


def test_bucket_validation():
    buf = torch.zeros(64, dtype=torch.uint8)
    meta = TensorMeta("w", "float32", (2,), 0, 8)
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        FlattenedBucket(buf.view(torch.float32), (meta,))
    with pytest.raises(ValueError, match="overlaps"):
        FlattenedBucket(buf, (meta, TensorMeta("v", "float32", (2,), 4, 8)))
    with pytest.raises(ValueError, match="misaligned"):
        FlattenedBucket(buf[1:], (meta,))
    with pytest.raises(ValueError, match="tuple of TensorMeta"):
        FlattenedBucket(buf, [meta])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nbytes": 12}, "nbytes=12"),
        ({"dtype": "float128"}, "unsupported dtype name"),
        ({"offset": -16}, "offset"),
        ({"offset": 2}, "offset"),
        ({"shape": (2, -1)}, "shape"),
        ({"shape": [2]}, "shape"),
    ],
)
def test_meta_validation_names_the_tensor(kwargs, message):
    fields = {"name": "layer.w", "dtype": "float32", "shape": (2,), "offset": 0, "nbytes": 8}
    with pytest.raises(ValueError, match=message):
        TensorMeta(**{**fields, **kwargs})


def test_dtype_names():
    for dtype in SUPPORTED_DTYPES:
        assert str_to_dtype(dtype_to_str(dtype)) is dtype
    assert dtype_to_str(torch.float) == "float32"
    for bad in (torch.qint8, "float32", None):
        with pytest.raises(ValueError, match="unsupported dtype"):
            dtype_to_str(bad)
    for bad in ("float", "torch.float32", "qint8", 3):
        with pytest.raises(ValueError, match="unsupported dtype name"):
            str_to_dtype(bad)


_tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(SUPPORTED_DTYPES),
        st.lists(st.integers(0, 5), max_size=3),
        st.booleans(),
    ),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(specs=_tensor_specs, bucket_bytes=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_pack_unpack_property(specs, bucket_bytes, seed):
    tensors = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        tensor = _random_tensor(tuple(shape), dtype, seed + i)
        tensors.append((f"t{i}", tensor.mT if transpose and tensor.dim() >= 2 else tensor))
    buckets = list(pack_buckets(tensors, bucket_bytes))
    _assert_same(tensors, _unpack_all(buckets))
    for bucket in buckets:
        assert bucket.buffer.numel() <= bucket_bytes or len(bucket.metas) == 1
        assert all(m.offset % ALIGN_BYTES == 0 for m in bucket.metas)
        FlattenedBucket(bucket.buffer, bucket.metas)  # re-validates
