"""The engine's Triton attention backend against transformers (CPU: Triton's interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.rollout_engine.hf_reference import hf_greedy, hf_logprobs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1")


def test_triton_backend_greedy_parity(tiny_paths, make_engine):
    path = tiny_paths["qwen3"]
    engine = make_engine(path, attention_backend="triton", page_size=4)
    prompts = [[5, 6, 7, 8, 9], list(range(40, 61))]
    first = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                                "max_new_tokens": 4},
                            return_logprob=True)
    # the second request for prompt 1 extends on top of a cached prefix
    again = engine.generate(input_ids=prompts[1], sampling_params={"temperature": 0,
                                                                   "max_new_tokens": 4},
                            return_logprob=True)
    assert again["meta_info"]["cached_tokens"] > 0
    for prompt, out in zip(prompts + [prompts[1]], first + [again]):
        assert out["output_ids"] == hf_greedy(path, prompt, 4)
        ref = hf_logprobs(path, prompt + out["output_ids"])[len(prompt):]
        err = max(abs(lp - r) for (lp, _, _), r in zip(out["meta_info"]["output_token_logprobs"],
                                                       ref.tolist()))
        assert err <= 1e-4
