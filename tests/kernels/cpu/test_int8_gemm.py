"""The W8A8 int8 kernel (kernels/cpu/int8_gemm.cpp) against its definition, bit for bit, and
the checks of its wrapper."""

from __future__ import annotations

import pytest
import torch
from rollout_engine_kernels.cpu import int8_gemm


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def op():
    got = int8_gemm.load_int8_gemm()
    assert got is not None, "the int8 GEMM kernel did not build"
    assert got.fast == _has_avx2()
    return got


def _quantized(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen)
    w[0] = 0.0                                    # a zero row: scale 1
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 24, 64), (2, 5, 15), (3, 7, 33),
                                   (5, 130, 200), (16, 96, 896), (33, 64, 1000),
                                   (64, 257, 128), (130, 9, 4864)])
def test_equals_the_definition_bit_for_bit(op, m, n, k):
    gen = torch.Generator().manual_seed(m * 10000 + n * 10 + k)
    q, scale = _quantized(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 4
    x[m // 2] = 0.0                               # a zero token
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        got = op(x, q, scale.reshape(-1).contiguous(), b)
        assert torch.equal(got, int8_gemm.int8_linear_ref(x, q, scale, b))


def test_extremes_do_not_saturate(op):
    """+-127 against +-127 over long rows: pairs pass int16, the int32 sums must not."""
    k = 4096
    x = torch.ones(3, k)
    x[1] = -1.0
    q = torch.full((4, k), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.ones(4)
    got = op(x, q, scale)
    assert torch.equal(got, int8_gemm.int8_linear_ref(x, q, scale))
    assert got[0, 0] == 127 * 127 * k / 127   # s_x = 1 / 127


def test_strided_rows(op):
    gen = torch.Generator().manual_seed(3)
    q_full, scale = _quantized(40, 96, gen)
    x_full = torch.randn(6, 128, generator=gen)
    x, q = x_full[:, :96], torch.cat((q_full, q_full), dim=1)[:, :96]
    got = op(x, q, scale.reshape(-1).contiguous())
    assert torch.equal(got, int8_gemm.int8_linear_ref(x, q, scale))


def test_bad_arguments_are_refused(op):
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8_gemm"):
        op(torch.zeros(2, 8, dtype=torch.float64), q, torch.ones(4))
    with pytest.raises(ValueError, match=r"int8_gemm: x \(2, 7\)"):
        op(torch.zeros(2, 7), q, torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        op(torch.zeros(2, 8), q, torch.ones(3))


@pytest.mark.parametrize("n,k", [(1, 1), (3, 17), (130, 200), (896, 4864)])
def test_weight_rows_quantize_as_the_definition(op, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 3
    w[0] = 0.0
    if k >= 3:   # scale 1: values half way between two integers, rounded to the even one
        w[-1] = 0.0
        w[-1, :3] = torch.tensor([127.0, 2.5, -1.5])
    q, scale = op.quantize_rows(w)
    q_ref, scale_ref = int8_gemm.quantize_rows_ref(w)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    if k >= 3:
        assert q[-1, :3].tolist() == [127, 2, -2]
    strided = torch.cat((w, w), dim=1)[:, :k]
    assert torch.equal(op.quantize_rows(strided)[0], q_ref)
    with pytest.raises(ValueError, match="quantize_rows"):
        op.quantize_rows(w.double())
