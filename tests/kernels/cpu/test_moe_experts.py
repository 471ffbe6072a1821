"""The MoE experts kernel (kernels/cpu/moe_experts.cpp) against a float64 per-expert reference;
a row's result does not depend on its expert's other rows or on the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_engine_kernels.cpu import moe_experts


@pytest.fixture(scope="module")
def op():
    got = moe_experts.load_moe_experts()
    assert got is not None, "the MoE experts kernel did not build"
    return got


def _case(rows_per_expert: list[int], h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = len(rows_per_expert)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    xs = torch.randn(sum(rows_per_expert), h, generator=g)
    offsets = torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])
    return xs, w13, w2, offsets


def _reference(xs, w13, w2, offsets) -> torch.Tensor:
    out = torch.empty(xs.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        a, b = int(offsets[e]), int(offsets[e + 1])
        gate, up = F.linear(xs[a:b].double(), w13[e].double()).chunk(2, dim=-1)
        out[a:b] = F.linear(F.silu(gate) * up, w2[e].double())
    return out


@pytest.mark.parametrize("rows,h,i", [([1, 0, 3, 5, 0, 2], 64, 32), ([4] * 16, 512, 192),
                                      ([0, 9, 1], 37, 13), ([33, 1], 24, 40)])
def test_matches_a_float64_reference(op, rows, h, i) -> None:
    xs, w13, w2, offsets = _case(rows, h, i)
    got = op(xs, w13, w2, offsets)
    torch.testing.assert_close(got.double(), _reference(xs, w13, w2, offsets),
                               rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_neighbours_or_threads(op) -> None:
    xs, w13, w2, offsets = _case([7, 2, 5], 96, 40)
    full = op(xs, w13, w2, offsets)
    # row 3 of expert 0 alone (expert 0 has one row, the others none)
    alone = op(xs[3:4].contiguous(), w13, w2, torch.tensor([0, 1, 1, 1]))
    assert torch.equal(alone[0], full[3])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(op(xs, w13, w2, offsets), full)
    finally:
        torch.set_num_threads(before)


def test_bad_shapes_are_refused(op) -> None:
    xs, w13, w2, offsets = _case([2, 2], 32, 16)
    with pytest.raises(ValueError, match="offsets"):
        op(xs, w13, w2, torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="float32"):
        op(xs.double(), w13, w2, offsets)


def test_sigmoid_is_the_same_bits_wherever_an_element_sits(op) -> None:
    x = torch.randn(1000) * 4
    whole = op.sigmoid(x)
    torch.testing.assert_close(whole, torch.sigmoid(x), rtol=1e-6, atol=1e-7)
    assert all(torch.equal(op.sigmoid(x[i:i + 1].contiguous()), whole[i:i + 1])
               for i in range(0, 1000, 37))
