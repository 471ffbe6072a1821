"""rmsnorm (Triton) vs rmsnorm_ref (PyTorch) vs Hugging Face LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout_engine_kernels.triton.rmsnorm import rmsnorm, rmsnorm_ref  # noqa: E402

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32 in and out
# bf16/fp16 on CUDA: same rounding points as HF, so at most one ulp apart (sum order differs).
LOW_PRECISION_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _inputs(num_rows, hidden, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=gen) * 3 + 0.5
    residual = torch.randn(num_rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    return x.to(device, dtype), weight.to(device, dtype), residual.to(device, dtype)


@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 16), (7, 48), (5, 100), (3, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_ref(device, num_rows, hidden, with_residual):
    x, weight, residual = _inputs(num_rows, hidden, torch.float32, device, seed=hidden)
    x_before, residual_before = x.clone(), residual.clone()
    if with_residual:
        out, new_residual = rmsnorm(x, weight, 1e-6, residual)
        ref_out, ref_residual = rmsnorm_ref(x, weight, 1e-6, residual)
        torch.testing.assert_close(new_residual, ref_residual, **FP32_TOL)
    else:
        out, ref_out = rmsnorm(x, weight, 1e-6), rmsnorm_ref(x, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_ref_matches_hf_llama():
    """The reference is HF's LlamaRMSNorm applied to x + residual (bit-exact in bf16)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight, residual = _inputs(6, 64, torch.bfloat16, "cpu", seed=1)
    hf = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x + residual)
    out, new_residual = rmsnorm_ref(x, weight, 1e-5, residual)
    assert torch.equal(out, expected) and torch.equal(new_residual, x + residual)


def test_rmsnorm_rejects_mismatched_weight(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.ones(4, device=device), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_low_precision_cuda(dtype):
    x, weight, residual = _inputs(33, 4096, dtype, "cuda", seed=3)
    out, new_residual = rmsnorm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rmsnorm_ref(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)  # one rounding of an fp32 sum on both sides
    torch.testing.assert_close(out, ref_out, **LOW_PRECISION_TOL)
