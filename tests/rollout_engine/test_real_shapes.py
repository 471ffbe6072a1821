"""Parity with transformers on real checkpoints' shapes (``testing/real_shapes.py``), cut to two
layers: head_dim 128 over a 1,024 hidden size (Qwen3-0.6B), GQA 7:1 and q/k/v biases
(Qwen2.5-0.5B), llama3 RoPE scaling with theta 500,000 (Llama-3.2-1B), 128-152k vocabularies
and tied LM heads. float32: token-exact greedy and logprobs within 1e-4; bfloat16: the
low-precision rule of ``testing/parity.py``."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.testing.parity import engine_vs_hf, load_hf
from rollout_engine.testing.real_shapes import REAL_SHAPES, real_shape_path
from tests.rollout_engine.hf_reference import hf_greedy, hf_logprobs

MAX_NEW = 8


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 41, 130)]


def test_the_shapes_are_the_checkpoints() -> None:
    from rollout_engine.models.llama import ModelArch
    from rollout_engine.testing.tiny_model import TinyModelSpec, hf_config

    arch = ModelArch.from_hf_config(hf_config(TinyModelSpec(**REAL_SHAPES["qwen3-0.6b"])))
    assert (arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.vocab_size) == \
        (128, 16, 8, 151936)
    assert REAL_SHAPES["qwen2.5-0.5b"]["num_heads"] // REAL_SHAPES["qwen2.5-0.5b"][
        "num_kv_heads"] == 7


# -m slow: ~15-25 s each with the two-layer model's build (a 150k-row embedding)
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_float32_parity(name, make_engine) -> None:
    path = str(real_shape_path(name, num_layers=2))
    vocab = REAL_SHAPES[name]["vocab_size"]
    engine = make_engine(path, max_total_tokens=2048)
    prompts = _prompts(vocab)
    outs = engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}, return_logprob=True)
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, MAX_NEW), f"prompt of {len(prompt)}"
        lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        ref = hf_logprobs(path, prompt + out["output_ids"])[len(prompt):]
        assert (lps - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_bfloat16_parity(name, make_engine) -> None:
    path = str(real_shape_path(name, num_layers=2))
    engine = make_engine(path, dtype="bfloat16", max_total_tokens=2048)
    reports = engine_vs_hf(engine, load_hf(path, torch.bfloat16, "cpu"),
                           _prompts(REAL_SHAPES[name]["vocab_size"]), MAX_NEW)
    for report in reports:
        assert report.ok, report
    assert sum(r.compared_tokens for r in reports) >= 6
