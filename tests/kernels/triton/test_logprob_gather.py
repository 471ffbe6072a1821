"""logprob_gather (Triton) vs logprob_gather_ref (PyTorch log_softmax + gather)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout_engine_kernels.triton.logprob_gather import (  # noqa: E402
    logprob_gather,
    logprob_gather_ref,
)

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32 logits
LOW_PRECISION_TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16 logits on CUDA (math is fp32 in both)


def _inputs(batch, vocab_size, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab_size, generator=gen) * 4).to(device, dtype)
    token_ids = torch.randint(0, vocab_size, (batch,), generator=gen).to(device)
    temperatures = (torch.rand(batch, generator=gen) * 1.5 + 0.5).to(device)
    return logits, token_ids, temperatures


@pytest.mark.parametrize(("batch", "vocab_size"), [(1, 17), (4, 1000), (3, 2500)])
def test_logprob_gather_matches_ref(device, batch, vocab_size):
    args = _inputs(batch, vocab_size, torch.float32, device, seed=vocab_size)
    torch.testing.assert_close(logprob_gather(*args), logprob_gather_ref(*args), **FP32_TOL)


def test_logprob_gather_ref_sums_to_one():
    """Gathering every token id of a row gives a distribution (exp sums to 1)."""
    logits, _, _ = _inputs(1, 50, torch.float32, "cpu", seed=0)
    ids = torch.arange(50)
    logprobs = logprob_gather_ref(logits.expand(50, -1), ids, torch.full((50,), 0.7))
    torch.testing.assert_close(logprobs.exp().sum(), torch.tensor(1.0), **FP32_TOL)


@pytest.mark.gpu
def test_logprob_gather_low_precision_cuda():
    args = _inputs(16, 128256, torch.bfloat16, "cuda", seed=1)
    torch.testing.assert_close(
        logprob_gather(*args), logprob_gather_ref(*args), **LOW_PRECISION_TOL
    )
