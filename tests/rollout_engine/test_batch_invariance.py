"""``enable_deterministic_inference``: a request's tokens and logprobs are bitwise those of the
same request run alone, whatever runs beside it (random neighbours with their own sampling,
top-p, top logprobs), however its prompt is chunked, with or without a radix hit, after
retractions, with 1 or 2 threads, in thread and process mode (``models/batch_invariant.py``).
Without the flag the same comparison differs (the check can fail)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NEW = 12
VOCAB = 500


def _sp(seed: int, greedy: bool) -> dict[str, Any]:
    return {"temperature": 0.0 if greedy else 1.0, "max_new_tokens": NEW, "ignore_eos": True,
            "sampling_seed": seed}


def _run(engine: Any, prompts: list[list[int]], sps: list[dict], top: list[int]
         ) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=sps, return_logprob=True,
                           top_logprobs_num=top)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])   # the flat decode loop; the modules
def engines(request, tiny_paths):
    from rollout_engine import Engine

    path = tiny_paths[request.param]
    made = {
        # 2 threads, 48-token chunks
        "a": Engine(model_path=path, device="cpu", dtype="float32", num_threads=2,
                    scheduler_mode="thread", enable_deterministic_inference=True,
                    chunked_prefill_size=48, random_seed=0),
        # 1 thread, 128-token chunks, a pool small enough to retract
        "b": Engine(model_path=path, device="cpu", dtype="float32", num_threads=1,
                    scheduler_mode="thread", enable_deterministic_inference=True,
                    chunked_prefill_size=128, max_total_tokens=1200, random_seed=0),
    }
    yield {**made, "path": path}
    for e in made.values():
        e.shutdown()


def _pair(engines: dict[str, Any]) -> list[tuple[str, Any]]:
    return [("a", engines["a"]), ("b", engines["b"])]


@st.composite
def _batches(draw):
    rng = random.Random(draw(st.integers(0, 2**31)))
    size = draw(st.integers(1, 24))
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 160))]
               for _ in range(size)]
    shared = draw(st.booleans())    # GRPO-like: neighbours sharing the target's prompt
    target = draw(st.integers(0, size - 1))
    if shared:
        for i in range(0, size, 2):
            prompts[i] = list(prompts[target])
    sps = [{**_sp(rng.randrange(1000), rng.random() < 0.3),
            **({"top_p": 0.9} if rng.random() < 0.3 else {})} for _ in range(size)]
    top = [rng.choice([0, 0, 2]) for _ in range(size)]
    return prompts, sps, top, target


@settings(max_examples=int(__import__('os').environ.get('BI_EXAMPLES', '10')), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=_batches())
def test_a_request_in_any_batch_equals_it_alone(engines, batch) -> None:
    prompts, sps, top, target = batch
    alone = {}
    for name, engine in _pair(engines):
        engine.flush_cache()      # alone from an empty cache: no radix hit
        alone[name] = _run(engine, [prompts[target]], [sps[target]], [top[target]])[0]
    assert alone["a"] == alone["b"]          # 1 or 2 threads, chunks of 48 or 128
    for name, engine in _pair(engines):
        got = _run(engine, prompts, sps, top)[target]
        assert got == alone[name], name      # tokens and logprobs, bit for bit
        again = _run(engine, [prompts[target]], [sps[target]], [top[target]])[0]
        assert again == alone[name], name    # a radix hit on its own prompt


def test_retractions_happened_and_left_results_unchanged(engines) -> None:
    engine = engines["b"]
    rng = random.Random(3)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(150)] for _ in range(16)]
    sps = [{**_sp(i, False), "max_new_tokens": 60} for i in range(16)]
    before = engine.get_server_info()["stats"]["num_retractions"]
    batch = _run(engine, prompts, sps, [0] * 16)
    assert engine.get_server_info()["stats"]["num_retractions"] > before
    engine.flush_cache()
    assert _run(engine, [prompts[5]], [sps[5]], [0])[0] == batch[5]


def test_process_mode_equals_thread_mode(qwen2_path) -> None:
    from rollout_engine import Engine

    rng = random.Random(5)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 120))]
               for _ in range(6)]
    sps = [_sp(i, i % 2 == 0) for i in range(6)]
    got = {}
    for mode, chunk in (("thread", 48), ("process", 32)):
        e = Engine(model_path=qwen2_path, device="cpu", dtype="float32", num_threads=2,
                   scheduler_mode=mode, enable_deterministic_inference=True,
                   chunked_prefill_size=chunk, random_seed=0)
        try:
            got[mode] = _run(e, prompts, sps, [0] * 6) if mode == "process" else \
                _run(e, prompts[:1], sps[:1], [0])
        finally:
            e.shutdown()
    assert got["process"][0] == got["thread"][0]


def test_without_the_flag_a_neighbour_changes_the_bits(qwen2_path) -> None:
    """The comparison above can fail: the fast path's products follow the batch's row count."""
    from rollout_engine import Engine

    e = Engine(model_path=qwen2_path, device="cpu", dtype="float32", num_threads=2,
               scheduler_mode="thread", chunked_prefill_size=48, random_seed=0)
    try:
        rng = random.Random(0)
        target = [rng.randrange(5, VOCAB) for _ in range(100)]
        others = [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 300))]
                  for _ in range(12)]
        alone = _run(e, [target], [_sp(7, False)], [0])[0]
        e.flush_cache()
        mixed = _run(e, others[:6] + [target] + others[6:], [_sp(7, False)] * 13, [0] * 13)[6]
        assert mixed[1] != alone[1]
    finally:
        e.shutdown()


def test_refused_where_it_cannot_be_honoured(qwen2_path) -> None:
    from rollout_engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_deterministic_inference.*float32 on CPU"):
        EngineConfig(model_path=qwen2_path, device="cpu", dtype="bfloat16",
                     enable_deterministic_inference=True)
    with pytest.raises(ValueError, match="enable_deterministic_inference.*NGRAM only"):
        EngineConfig(model_path=qwen2_path, device="cpu", dtype="float32",
                     speculative_algorithm="STANDALONE", speculative_draft_model_path=qwen2_path,
                     enable_deterministic_inference=True)


def test_a_grpo_batch_of_256(engines) -> None:
    """32 prompts x 8 samples in one batch (the property above draws up to 24): three of
    them equal their runs alone."""
    engine = engines["a"]
    rng = random.Random(11)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(20, 130))]
               for _ in range(32)]
    batch_prompts = [p for p in prompts for _ in range(8)]
    sps = [_sp(i, False) for i in range(256)]
    engine.flush_cache()
    batch = _run(engine, batch_prompts, sps, [0] * 256)
    for i in (0, 77, 255):
        engine.flush_cache()
        assert _run(engine, [batch_prompts[i]], [sps[i]], [0])[0] == batch[i]


def test_ngram_speculation_changes_no_bit(qwen2_path) -> None:
    """Drafts verified in one extend per request give the plain path's tokens and logprobs."""
    from rollout_engine import Engine

    rng = random.Random(0)
    base = [rng.randrange(5, VOCAB) for _ in range(30)]   # repeats: n-gram drafts match
    prompts = [base * 3 + [rng.randrange(5, VOCAB) for _ in range(i)] for i in range(1, 7)]
    sps = [{**_sp(i, i % 2 == 0), "max_new_tokens": 40} for i in range(6)]
    got, accepted = {}, 0
    for algo in (None, "NGRAM"):
        e = Engine(model_path=qwen2_path, device="cpu", dtype="float32", random_seed=0,
                   scheduler_mode="thread", enable_deterministic_inference=True,
                   speculative_algorithm=algo,
                   **({"speculative_num_draft_tokens": 4} if algo else {}))
        try:
            got[algo] = _run(e, prompts, sps, [0] * 6)
            accepted = e.get_server_info()["stats"].get("spec_accepted_tokens", accepted)
        finally:
            e.shutdown()
    assert accepted > 0
    assert got["NGRAM"] == got[None]


def test_a_prefix_loaded_back_from_hicache_changes_no_bit(qwen2_path) -> None:
    from rollout_engine import Engine

    e = Engine(model_path=qwen2_path, device="cpu", dtype="float32", scheduler_mode="thread",
               enable_deterministic_inference=True, random_seed=0, max_total_tokens=600,
               enable_hierarchical_cache=True, hicache_ratio=8.0)
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(5, VOCAB) for _ in range(200)]
        first = _run(e, [prompt], [_sp(3, False)], [0])[0]
        for _ in range(6):    # evict its KV from the device pool to the host tier
            _run(e, [[rng.randrange(5, VOCAB) for _ in range(250)]], [_sp(4, False)], [0])
        again = _run(e, [prompt], [_sp(3, False)], [0])[0]
        assert e.get_server_info()["hicache"]["host_hit_tokens"] >= 150
        assert again == first
    finally:
        e.shutdown()
