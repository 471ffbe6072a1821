"""Speculation changes nothing a trainer sees: tokens and logprobs equal the plain engine's.

Each pair of engines runs the same requests with NGRAM speculation on and off. Greedy outputs
must be token-identical; seeded sampled outputs are identical too (the verify step draws output
token ``n`` with the same counter-based uniform as the plain sampler: see
``rollout_engine/speculative/verify.py``), and every logprob matches within 1e-4. Each test also
asserts that proposals were made and accepted, so a scheduler that silently never speculates
fails. ``debug_integrity`` checks the KV invariant whenever an engine goes idle; the fixtures
check it again at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import SPEC, repeated_prompts, run, spec_counts

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def pair(request: pytest.FixtureRequest, tiny_paths: dict[str, str]) -> Iterator[Any]:
    """(spec off, spec on) engines on one tiny architecture."""
    path = tiny_paths[request.param]
    for plain in thread_engine(path, debug_integrity=True):
        for spec in thread_engine(path, **SPEC):
            yield plain, spec


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]], logprobs: bool = False) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert x["meta_info"]["finish_reason"] == y["meta_info"]["finish_reason"]
        if logprobs:
            lx = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
            ly = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
            assert len(lx) == len(ly) == len(x["output_ids"])
            assert max(abs(p - q) for p, q in zip(lx, ly)) < LOGPROB_TOL
            for tx, ty in zip(x["meta_info"]["output_top_logprobs"],
                              y["meta_info"]["output_top_logprobs"]):
                assert [t[1] for t in tx] == [t[1] for t in ty]
                assert max(abs(p[0] - q[0]) for p, q in zip(tx, ty)) < LOGPROB_TOL


def test_greedy_outputs_and_logprobs_are_identical(pair: Any) -> None:
    plain, spec = pair
    prompts = repeated_prompts(4, seed=1)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    a = run(plain, prompts, params, return_logprob=True, top_logprobs_num=3)
    b = run(spec, prompts, params, return_logprob=True, top_logprobs_num=3)
    assert_same(a, b, logprobs=True)
    verify_ct, accepted = spec_counts(b)
    assert accepted > 0 and verify_ct < sum(len(o["output_ids"]) for o in b)
    assert "spec_verify_ct" not in a[0]["meta_info"]


def test_seeded_sampling_draws_the_same_tokens_with_filters(pair: Any) -> None:
    plain, spec = pair
    prompts = repeated_prompts(3, seed=2)
    params = [{"temperature": t, "top_p": p, "top_k": k, "min_p": m, "max_new_tokens": 32,
               "ignore_eos": True, "sampling_seed": 7 + i}
              for i, (t, p, k, m) in enumerate([(0.7, 1.0, -1, 0.0), (1.0, 0.9, 30, 0.0),
                                                (0.5, 0.8, -1, 0.1)])]
    a = run(plain, prompts, params, return_logprob=True, top_logprobs_num=2)
    b = run(spec, prompts, params, return_logprob=True, top_logprobs_num=2)
    assert_same(a, b, logprobs=True)
    assert spec_counts(b)[0] > 0


def test_stops_lengths_and_penalties_stay_correct(pair: Any) -> None:
    plain, spec = pair
    prompts = repeated_prompts(4, seed=3)
    # a stop token that greedy decoding reaches mid-way, a stop string, min_new_tokens with
    # EOS allowed, and penalties (those run without proposals)
    probe = run(plain, prompts[:1], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    stop_at = probe[0]["output_ids"][9]
    text = probe[0]["text"]
    params = [
        {"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [stop_at], "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 24, "stop": [text[5:8]] if len(text) > 8 else []},
        {"temperature": 0, "max_new_tokens": 17, "min_new_tokens": 9},
        {"temperature": 0.8, "max_new_tokens": 20, "frequency_penalty": 0.5,
         "repetition_penalty": 1.2, "sampling_seed": 3, "ignore_eos": True},
    ]
    a = run(plain, prompts[:1] * 2 + prompts[2:], params)
    b = run(spec, prompts[:1] * 2 + prompts[2:], params)
    assert_same(a, b)
    assert b[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(b[0]["output_ids"]) <= 10
    assert len(b[3]["output_ids"]) == 20


def test_a_large_batch_switches_speculation_off(tiny_paths: dict[str, str]) -> None:
    path = tiny_paths["qwen2"]
    prompts = repeated_prompts(5, seed=4)
    # staggered lengths: the last two run on alone, in batches small enough to speculate
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
              for n in (16, 18, 20, 40, 44)]
    for plain in thread_engine(path):
        ref = run(plain, prompts, params)
    for spec in thread_engine(path, **SPEC, speculative_max_batch_size=2):
        got = run(spec, prompts, params)
        stats = spec.get_server_info()["stats"]
    assert_same(ref, got)
    assert stats["spec_off_steps"] > 0          # 5 running > 2: plain decode steps
    assert stats["spec_verify_steps"] > 0       # the tail (<= 2 running) speculated
