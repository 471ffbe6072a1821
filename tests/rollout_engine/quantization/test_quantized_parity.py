"""A quantized engine's greedy tokens and logprobs against the plain-PyTorch reference of its
scheme (``reference.py``: transformers' model with fake-quantized linears), on the tiny
qwen2 / qwen3 / llama models."""

from __future__ import annotations

import random

import pytest

from tests.conftest import ARCHS
from tests.rollout_engine.hf_reference import hf_logprobs
from tests.rollout_engine.quantization.reference import reference_greedy, reference_logprobs

MAX_NEW = 8
LOGPROB_TOL = 1e-4   # float32 sums in another order
JITTERS = (0.0, 3e-7, -3e-7, 1e-6, -1e-6)
"""An activation within ~1e-7 of a quantization rounding edge may round either way in two
float32 computations (and then moves later logprobs by up to ~0.05 in these tiny models); a
position matches when the reference at one of these input jitters gives its logprob."""


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 60)]


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
@pytest.mark.parametrize("arch", [   # qwen2 in the default suite, the others in the long one
    pytest.param(a, marks=() if a == "qwen2" else pytest.mark.slow) for a in ARCHS])
def test_quantized_engine_matches_the_reference(arch, method, tiny_paths, make_engine):
    path = tiny_paths[arch]
    engine = make_engine(path, quantization=method)
    prompts = _prompts(engine.tm.vocab_size)
    outs = engine.generate(input_ids=prompts, return_logprob=True,
                           sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    quantization_shows = False
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == reference_greedy(path, method, prompt, MAX_NEW)
        ids = prompt + out["output_ids"]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        refs = [reference_logprobs(path, method, ids, j)[len(prompt):] for j in JITTERS]
        errors = [min(abs(g - ref[i]) for ref in refs) for i, g in enumerate(got)]
        assert max(errors) <= LOGPROB_TOL, errors
        plain = hf_logprobs(path, ids)[len(prompt):].tolist()
        quantization_shows |= max(abs(a - b) for a, b in zip(got, plain)) > 10 * LOGPROB_TOL
    assert quantization_shows   # the reference is not simply the unquantized model


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
def test_deterministic_inference_stays_batch_invariant(method, tiny_paths, make_engine):
    """Per-token activation scales and exact int32 sums: a sampled rollout's tokens and
    logprobs do not depend on the batch it ran in (on-policy RL's requirement)."""
    engine = make_engine(tiny_paths["qwen2"], quantization=method,
                         enable_deterministic_inference=True)
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
    alone = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp, return_logprob=True)
    batch = engine.generate(input_ids=[[5, 6, 7, 8]] + [[9] * k for k in range(3, 40, 5)],
                            sampling_params=sp, return_logprob=True)[0]
    assert batch["output_ids"] == alone["output_ids"]
    assert (batch["meta_info"]["output_token_logprobs"]
            == alone["meta_info"]["output_token_logprobs"])
