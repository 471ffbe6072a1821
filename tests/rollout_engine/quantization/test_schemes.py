"""The schemes' math: the fast int8 product against its reference on random shapes, the
weight and activation quantizers' definitions, FP8 blocks round trip."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.quantization import fp8, int8

SHAPES = [(1, 64, 24), (5, 64, 96), (17, 200, 130), (64, 256, 384), (3, 1000, 7)]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int8_product_matches_its_reference(rows, k, n):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w, b = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, k, generator=gen), \
        torch.randn(n, generator=gen)
    q, scale = int8.quantize_weight_int8(w)
    packed = int8.prepack(q, scale)
    assert packed is not None   # the fast product runs on this machine
    got = int8.int8_linear(x, packed, b)
    ref = int8.int8_linear_ref(x, q, scale, b)
    # the int32 sums are exact in both; the rescale's float32 order differs
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and it is the W8A8 product: close to the float one, not equal to it
    assert 0 < (ref - x @ w.T - b).abs().max() < 0.05 * (x @ w.T).abs().max()


def test_int8_sums_do_not_saturate():
    """Activations at +-127 against weights at +-127: pairs of products pass int16 (the case
    a one-pass u8 x s8 product without VNNI clips)."""
    k = 256
    x = torch.full((4, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    w = torch.ones(8, k)
    w[1] = -1.0
    q, scale = int8.quantize_weight_int8(w)
    got = int8.int8_linear(x, int8.prepack(q, scale))
    torch.testing.assert_close(got, x @ w.T, rtol=1e-6, atol=1e-4)


def test_int8_quantizers_are_per_row_and_per_token():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [254.0, 1.0, -127.0]])
    q, scale = int8.quantize_weight_int8(w)
    assert q.dtype is torch.int8 and scale.shape == (3, 1) and scale.dtype is torch.float32
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 0, -64]]   # 63.5 -> 64 (even)
    assert torch.equal(scale[:, 0], torch.tensor([1.0 / 127, 1.0, 2.0]))   # float32
    xq, xs = int8.quantize_tokens_int8(w)
    assert torch.equal(xq.to(torch.int8), q) and torch.equal(xs, scale)


@pytest.mark.parametrize("n,k", [(128, 128), (200, 300), (64, 64), (257, 129)])
def test_fp8_blocks_round_trip(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    w[:, :3] *= 40   # one tile's scale much larger than its neighbours'
    q, scale_inv = fp8.quantize_blocks(w)
    assert q.dtype is fp8.FP8_DTYPE and scale_inv.shape == fp8.scale_shape(n, k)
    assert torch.equal(scale_inv[0, 0], w[:128, :128].abs().max() / 448)
    deq = fp8.dequantize_blocks(q, scale_inv)
    tile_max = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] * 448
    assert ((deq - w).abs() <= tile_max / 16).all()        # e4m3: 3 mantissa bits
    assert torch.equal(fp8.quantize_blocks(deq)[0].float(), q.float())   # a fixed point


def test_fp8_scales_must_match_the_weight():
    q, scale_inv = fp8.quantize_blocks(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"block scales of shape \(2, 2\)"):
        fp8.dequantize_blocks(q, scale_inv[:, :2])


def test_fp8_activations_per_token_group():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    x[0, 200] = 1000.0          # only the third group of token 0 gets a coarse scale
    y = fp8.fake_quant_groups(x)
    assert y.shape == x.shape and not torch.equal(y, x)
    # each group on its own scale: the outlier changes its own group only
    assert torch.equal(y[0, :128], fp8.fake_quant_groups(x[0:1, :128])[0])
    assert torch.equal(y[0, 256:], fp8.fake_quant_groups(x[0:1, 256:])[0])
    assert ((y[1:] - x[1:]).abs() <= x[1:].abs() / 16 + 1e-3).all()   # 3 mantissa bits
    assert y[0, 200] == 1000.0
