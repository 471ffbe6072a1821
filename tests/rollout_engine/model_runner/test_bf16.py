"""The model path in bfloat16: RoPE frequencies stay float32, logits come out in float32 without
a bf16 rounding, and greedy parity with transformers holds under the low-precision rule (on CPU
here, tiny model; ``test_gpu_parity.py`` does the same on CUDA)."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.models.layers import linear_fp32_out
from rollout_engine.testing.parity import engine_vs_hf, load_hf
from tests.rollout_engine.model_runner.batches import make_reqs, prefill_batch


def test_bf16_runner_keeps_fp32_rope_and_logits(qwen2_path):
    runner = ModelRunner(EngineConfig(model_path=qwen2_path, device="cpu", dtype="bfloat16",
                                      max_total_tokens=64))
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
    assert runner.model.rotary.inv_freq.dtype == torch.float32
    reqs = make_reqs(runner, [[5, 6, 7, 8, 9, 10]], capacity=8)
    logits = runner.forward(prefill_batch(reqs, runner.device))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # a bf16 matmul cast up afterwards would leave only bf16-representable values
    assert (logits.bfloat16().float() != logits).any()


def test_bf16_engine_parity_with_transformers_cpu(tiny_paths, make_engine):
    path = tiny_paths["qwen3"]
    engine = make_engine(path, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, engine.tm.vocab_size, (n,), generator=g).tolist()
               for n in (4, 19, 40)]
    reports = engine_vs_hf(engine, load_hf(path, torch.bfloat16, "cpu"), prompts, 8)
    for report in reports:
        assert report.ok, report
    assert sum(r.compared_tokens for r in reports) >= 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_out_lm_head_on_cuda(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 512, generator=g).to("cuda", dtype)
    w = torch.randn(4096, 512, generator=g).to("cuda", dtype)
    got = linear_fp32_out(x, w)
    want = x.float() @ w.float().t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
