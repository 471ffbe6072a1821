"""The CPU linear (``models.layers.linear``: oneDNN on the plain weight) against ``F.linear``,
its autograd fallback, and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu.small_gemm import load_small_gemm

from rollout_engine.models import layers, weight_packs


@pytest.mark.parametrize("rows", [0, 1, 5, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    with torch.inference_mode():
        got = layers.linear(x, w, b)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_weights_changed_in_place_are_seen():
    """Nothing is prepacked: a refit that copies into the weight changes the next product."""
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    with torch.inference_mode():
        before = layers.linear(x, w)
        w.mul_(-2)
        after = layers.linear(x, w)
    torch.testing.assert_close(after, -2 * before, rtol=1e-5, atol=1e-5)


def test_autograd_falls_back_to_f_linear():
    x = torch.randn(3, 16, requires_grad=True)
    lin = layers.Linear(16, 4)
    y = lin(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_the_switch_turns_onednn_off(monkeypatch):
    calls = []
    weight_packs.packing_ok()   # its probe calls oneDNN itself: before counting
    monkeypatch.setenv(layers.ONEDNN_ENV, "0")
    layers._onednn_linear_ok.cache_clear()
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(1) or real(*a), raising=False)
    try:
        with torch.inference_mode():
            layers.linear(torch.randn(2, 8), torch.randn(3, 8))
        assert calls == []
        monkeypatch.setenv(layers.ONEDNN_ENV, "1")
        layers._onednn_linear_ok.cache_clear()
        with torch.inference_mode():
            layers.linear(torch.randn(2, 8), torch.randn(3, 8))
        assert len(calls) == (2 if torch.backends.mkldnn.is_available() else 0)   # probe + call
    finally:
        layers._onednn_linear_ok.cache_clear()


def test_long_extends_use_onednn(monkeypatch):
    """Every row count goes to oneDNN, long arbitrary prefill lengths included, and equals
    F.linear there."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    layers._onednn_linear_ok()   # probe first: it calls oneDNN itself
    calls.clear()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    with torch.inference_mode():
        for rows in (1024, 1025, 3001):
            x = torch.randn(rows, 16, generator=g)
            torch.testing.assert_close(layers.linear(x, w), F.linear(x, w),
                                       rtol=1e-5, atol=1e-5)
    # padded to their buckets (1025 -> 1088, 3001 -> 3072)
    assert calls == ([1024, 1088, 3072] if layers._onednn_linear_ok() else [])


def test_row_buckets_are_few_and_tight():
    """Every row count runs at a bucket at most 1/16 above it (exact up to 16 rows), and the
    buckets are few: 80 for 1-256 rows (decode batches), 16 an octave above."""
    buckets = [layers.onednn_rows(m) for m in range(1, 8193)]
    for m, b in zip(range(1, 8193), buckets):
        assert m <= b <= max(m, m * 17 // 16 + 1)
        assert layers.onednn_rows(b) == b
    assert buckets[:16] == list(range(1, 17))
    assert buckets == sorted(buckets)
    assert len(set(buckets[:256])) == 80
    assert len(set(buckets[4096:])) == 16   # rows 4097-8192


def test_padded_rows_equal_f_linear_and_reach_onednn_bucketed(monkeypatch):
    """Row counts off a bucket are padded with zero rows: the output (a view of the first rows,
    3-D inputs too) equals F.linear, and oneDNN only ever sees bucketed row counts (each shape
    it sees is a primitive it builds and keeps: memory of the serving process)."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    layers._onednn_linear_ok()
    calls.clear()
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    with torch.inference_mode():
        for rows in range(1, 300, 7):
            x = torch.randn(rows, 40, generator=g)
            got = layers.linear(x, w, b)
            assert got.shape == (rows, 24) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        x3 = torch.randn(3, 7, 40, generator=g)   # 21 rows: padded to 21 (exact under 32)
        torch.testing.assert_close(layers.linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)
        x3 = torch.randn(5, 29, 40, generator=g)   # 145 rows -> 152
        torch.testing.assert_close(layers.linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    if layers._onednn_linear_ok():
        assert calls and all(layers.onednn_rows(m) == m for m in calls)
        assert 152 in calls and 145 not in calls
        small = load_small_gemm()
        if small is not None and small.fast:   # an AVX-512 build takes 32-64 rows (32-128
            top = 64 if weight_packs.packing_ok() else 128
            assert not any(32 <= m <= top for m in calls)
            assert any(top < m <= 128 for m in calls) == weight_packs.packing_ok()
