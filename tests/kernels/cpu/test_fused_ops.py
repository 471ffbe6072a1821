"""The fused CPU ops (fused_ops.py, fused_ops.cpp) against their PyTorch references in
rollout_engine.models.layers, on decode and prefill sizes and odd shapes (row lengths and half
head dims that are not multiples of the 8-float vectors, strided rows, one token), and the
fallback."""

from __future__ import annotations

import pytest
import torch
from rollout_engine_kernels.cpu import build, fused_ops, paged_decode

from rollout_engine.models import layers
from rollout_engine.models.layers import RotaryEmbedding, rms_norm_ref, silu_mul_ref

TOKENS = [1, 3, 256, 4096]


@pytest.fixture(scope="module")
def ops() -> fused_ops.FusedOps:
    op = fused_ops.load_fused_ops()
    if op is None:
        pytest.fail("the CPU fused ops did not build (see the warning logged above)")
    return op


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n", [512, 13, 100, 2048])
def test_rmsnorm(ops, tokens: int, n: int) -> None:
    g = _gen(tokens * 7 + n)
    x = torch.randn(tokens, n + 5, generator=g)[:, 2:n + 2] * 3     # strided rows
    w = torch.randn(n, generator=g)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                               atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n", [512, 13, 100])
def test_add_rmsnorm(ops, tokens: int, n: int) -> None:
    g = _gen(tokens * 5 + n)
    x, residual = torch.randn(tokens, n, generator=g), torch.randn(tokens, n, generator=g)
    w = torch.randn(n, generator=g)
    want_res = residual + x
    want = rms_norm_ref(want_res, w, 1e-5)
    out = ops.add_rmsnorm(x, residual, w, 1e-5)
    assert torch.equal(residual, want_res)          # updated in place, exactly
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 64), (3, 1, 40), (4, 4, 16), (2, 1, 128)])
def test_rope_in_place(ops, tokens: int, hq: int, hk: int, d: int) -> None:
    g = _gen(tokens + hq * 100 + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, :hq * d].view(tokens, hq, d)                         # views into qkv
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    rot = RotaryEmbedding(d, 10000.0, None)
    cos, sin = rot.cos_sin(torch.randint(0, 5000, (tokens,), generator=g), torch.float32)
    want_q, want_k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
    ops.rope(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)            # v untouched


@pytest.mark.parametrize("tokens", [1, 3, 256])
@pytest.mark.parametrize("hq, hk, d", [(8, 2, 64), (4, 4, 16), (2, 1, 10)])
def test_rope_store_is_rope_then_set_kv(ops, tokens: int, hq: int, hk: int, d: int) -> None:
    """q rotated in place and the pool rows at loc exactly what ``rope`` then
    ``KVPool.set_kv`` leave; every other pool row and the rest of qkv untouched."""
    g = _gen(tokens * 7 + hq + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)
    slots = 3 * tokens + 5
    k_pool, v_pool = torch.randn(slots, hk, d, generator=g), torch.randn(slots, hk, d, generator=g)
    loc = torch.randperm(slots, generator=g)[:tokens]
    rot = RotaryEmbedding(d, 10000.0, None)
    cos, sin = rot.cos_sin(torch.randint(0, 5000, (tokens,), generator=g), torch.float32)
    ref_qkv, ref_k, ref_v = qkv.clone(), k_pool.clone(), v_pool.clone()
    q_ref = ref_qkv[:, :hq * d].view(tokens, hq, d)
    k_ref = ref_qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    ops.rope(q_ref, k_ref, cos, sin)
    ref_k[loc] = k_ref
    ref_v[loc] = ref_qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    kv_before = qkv[:, hq * d:].clone()
    ops.rope_store(qkv, hq, hk, cos, sin, loc, k_pool, v_pool)
    assert torch.equal(qkv[:, :hq * d], ref_qkv[:, :hq * d])
    assert torch.equal(qkv[:, hq * d:], kv_before)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)


def test_rope_store_refuses_a_slot_outside_the_pool(ops) -> None:
    qkv = torch.randn(2, (2 + 2) * 8)
    k_pool, v_pool = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    cos, sin = RotaryEmbedding(8, 10000.0, None).cos_sin(torch.tensor([0, 1]), torch.float32)
    for bad in ([1, 4], [-1, 0]):
        with pytest.raises(ValueError, match="outside the pool"):
            ops.rope_store(qkv, 2, 1, cos, sin, torch.tensor(bad), k_pool, v_pool)
        assert not k_pool.any() and not v_pool.any()     # nothing written
    with pytest.raises(ValueError, match="disagree"):
        ops.rope_store(qkv, 2, 1, cos, sin, torch.tensor([0, 1], dtype=torch.int32), k_pool,
                       v_pool)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n", [1408, 7, 100])
def test_silu_mul(ops, tokens: int, n: int) -> None:
    g = _gen(tokens * 3 + n)
    gate_up = torch.randn(tokens, 2 * n, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])     # exp range edges
    torch.testing.assert_close(ops.silu_mul(gate_up), silu_mul_ref(gate_up),
                               atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise(ops) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        ops.rmsnorm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError):
        ops.rmsnorm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        ops.add_rmsnorm(x, torch.randn(4, 8).t().contiguous().t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        ops.silu_mul(torch.randn(4, 7))
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    cos = torch.randn(4, 1, 8)
    with pytest.raises(ValueError):
        ops.rope(q, k, cos, torch.randn(3, 1, 8))
    with pytest.raises(ValueError):
        ops.rope(q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, cos)


def test_layers_use_the_reference_when_turned_off(monkeypatch) -> None:
    """``fused_ops_for`` is None for other dtypes and when the ops are off; the layer is then
    exactly the reference."""
    assert layers.fused_ops_for(torch.randn(2, 2, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(layers, "load_fused_ops", lambda: None)
    norm = layers.RMSNorm(16, 1e-6)
    x = torch.randn(5, 16)
    assert torch.equal(norm(x), rms_norm_ref(x, norm.weight, 1e-6))
    gu = torch.randn(5, 32)
    assert torch.equal(layers.silu_mul(gu), silu_mul_ref(gu))


def test_layers_take_the_fused_path(ops) -> None:
    norm = layers.RMSNorm(64, 1e-6)
    x, res = torch.randn(9, 64), torch.randn(9, 64)
    out, new_res = norm.add_forward(x, res.clone())
    torch.testing.assert_close(new_res, res + x, atol=0, rtol=0)
    torch.testing.assert_close(out, rms_norm_ref(res + x, norm.weight, 1e-6), atol=2e-6,
                               rtol=1e-6)


def test_a_library_of_another_abi_is_refused():
    """A stale build (here: a library without the ABI marker) is never called with this
    source's signatures."""
    other = build.build_library(paged_decode.SOURCE, "rollout_engine_paged_decode")
    with pytest.raises(RuntimeError, match="ABI None, expected"):
        fused_ops.FusedOps(other)
