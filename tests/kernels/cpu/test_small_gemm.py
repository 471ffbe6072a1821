"""The small-GEMM kernel (kernels/cpu/small_gemm.cpp) against a float64 reference, and where
`linear` uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu import small_gemm

from rollout_engine.models.layers import linear


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def op():
    got = small_gemm.load_small_gemm()
    assert got is not None, "the small GEMM kernel did not build"
    # the fast build exactly where the compiler targets AVX-512 (-march=native); elsewhere the
    # same code on 8-lane vectors, tested here all the same
    assert got.fast == _has_avx512()
    return got


def reference(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return (out + b.double() if b is not None else out).float()


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 7, 3), (16, 6, 64), (17, 13, 100),
                                   (32, 768, 512), (63, 31, 129), (64, 2816, 512),
                                   (65, 50, 1408), (100, 97, 64), (128, 1000, 512),
                                   (129, 11, 33), (300, 20, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference_on_ragged_shapes(op, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got = op(x, w, b)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got, reference(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_strided_rows_of_x_and_of_the_weight(op):
    gen = torch.Generator().manual_seed(1)
    big_x = torch.randn(48, 300, generator=gen)
    big_w = torch.randn(40, 320, generator=gen)
    x, w = big_x[:, 10:266], big_w[:, 3:259]        # row strides 300 and 320, K = 256
    torch.testing.assert_close(op(x, w), reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(op):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 512, generator=gen)
    w = torch.randn(200, 512, generator=gen)
    full = op(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = op(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    assert torch.equal(op(x[37:38], w)[0], full[37])      # one row alone
    assert torch.equal(op(x[20:53], w), full[20:53])      # 33 rows: another tail shape


def test_bad_shapes_are_refused(op):
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="small_gemm"):
        op(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="small_gemm"):
        op(x.t().contiguous().t(), w)                   # columns strided
    with pytest.raises(ValueError, match="small_gemm"):
        op(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="float32"):
        op(x.double(), w.double())


def test_linear_uses_it_only_where_it_is_fast(op, monkeypatch):
    calls = []
    real = small_gemm.SmallGemm.__call__
    monkeypatch.setattr(small_gemm.SmallGemm, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    with torch.inference_mode():
        linear(torch.randn(64, 32), torch.randn(48, 32))
    assert calls == ([64] if op.fast else [])


def test_which_products_it_takes():
    assert small_gemm.use_small_gemm(64, 768) and small_gemm.use_small_gemm(32, 512)
    assert small_gemm.use_small_gemm(128, 32000) and small_gemm.use_small_gemm(16, 32000)
    assert small_gemm.use_small_gemm(128, 768) and not small_gemm.use_small_gemm(129, 768)
    assert not small_gemm.use_small_gemm(256, 32000)   # and faster here
    assert not small_gemm.use_small_gemm(8, 32000)


@pytest.mark.parametrize("rows", [8, 40, 64, 100, 128, 300])
def test_linear_equals_f_linear_whichever_path_takes_it(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows // 2, 512, generator=gen)
    w = torch.randn(9000, 512, generator=gen)
    b = torch.randn(9000, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
