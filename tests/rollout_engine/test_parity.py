"""Token-exact greedy parity and logprob parity with transformers on the same directory."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.conftest import ARCHS
from tests.rollout_engine.hf_reference import hf_greedy, hf_logprobs

NUM_PROMPTS = 16
MAX_NEW = 12
LOGPROB_TOL = 1e-4


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 150, 200, 233, 270, 300]
    assert len(lengths) == NUM_PROMPTS
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


_REFERENCE: dict[str, list[list[int]]] = {}


def reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    if path not in _REFERENCE:
        _REFERENCE[path] = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    return _REFERENCE[path]


def run_staggered(engine, prompts: list[list[int]], **extra) -> list[dict]:
    """Submit prompts from threads at staggered times, so requests join a running batch."""
    results: list[dict | None] = [None] * len(prompts)

    def worker(i: int) -> None:
        time.sleep(0.01 * (i % 5))
        results[i] = engine.generate(
            input_ids=prompts[i], sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW},
            return_logprob=True, **extra)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def assert_parity(path: str, prompts: list[list[int]], results: list[dict]) -> None:
    ref = reference(path, prompts)
    for i, (prompt, res, expected) in enumerate(zip(prompts, results, ref)):
        assert res["output_ids"] == expected, f"prompt {i} (len {len(prompt)}) differs"
        lps = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        tf = hf_logprobs(path, prompt + res["output_ids"])[len(prompt):]
        assert len(lps) == len(res["output_ids"])
        err = max(abs(a - b) for a, b in zip(lps, tf.tolist()))
        assert err <= LOGPROB_TOL, f"prompt {i}: logprob error {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS + ("llama3_scaled",))
def test_greedy_and_logprob_parity(arch, tiny_paths, make_engine):
    path = tiny_paths[arch]
    engine = make_engine(path)
    prompts = _prompts(engine.tm.vocab_size)
    assert_parity(path, prompts, run_staggered(engine, prompts))


@pytest.mark.parametrize("flags", [
    {"chunked_prefill_size": 16},
    {"max_total_tokens": 320},                       # forces retraction in decode
    {"max_running_requests": 1},
    {"max_running_requests": 64},
    {"page_size": 16, "chunked_prefill_size": 64},
    {"disable_radix_cache": True},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_parity_under_scheduling_pressure(flags, tiny_paths, make_engine):
    path = tiny_paths["qwen2"]
    engine = make_engine(path, **flags)
    prompts = _prompts(engine.tm.vocab_size)
    if "max_total_tokens" in flags:
        # one batch, so the requests are admitted together and their decode outgrows the pool
        results = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": MAX_NEW}, return_logprob=True)
    else:
        results = run_staggered(engine, prompts)
    assert_parity(path, prompts, results)
    if "max_total_tokens" in flags:
        assert engine.get_server_info()["stats"]["num_retractions"] > 0


def test_parity_in_process_mode(tiny_paths, make_engine):
    path = tiny_paths["qwen3"]
    engine = make_engine(path, scheduler_mode="process")
    prompts = _prompts(engine.tm.vocab_size)[:6]
    results = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                                  "max_new_tokens": MAX_NEW},
                              return_logprob=True)
    ref = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    assert [r["output_ids"] for r in results] == ref


def test_prompt_logprobs(tiny_paths, make_engine):
    path = tiny_paths["llama"]
    engine = make_engine(path)
    prompt = _prompts(engine.tm.vocab_size)[8]
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 2},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    inp = out["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(prompt) and inp[0][0] is None
    tf = hf_logprobs(path, prompt)
    err = max(abs(lp - tf[i].item()) for i, (lp, tid, _) in enumerate(inp) if i > 0)
    assert err <= LOGPROB_TOL
    assert [tid for _, tid, _ in inp] == prompt
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 2 and all(len(t) == 3 for t in tops)
    # greedy: the chosen token is the top-1
    assert [t[0][1] for t in tops] == out["output_ids"]
