"""RadixAttention at the engine level: the prefix cache changes speed, never results.

Every test compares against the cache-off engine and/or transformers; the ``make_engine`` fixture
proves the KV invariant (free + cached + owned == total) when each test ends.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from rollout_engine.memory.radix_cache import RadixCache
from tests.rollout_engine.hf_reference import hf_greedy, hf_logprobs

MAX_NEW = 8
LOGPROB_TOL = 1e-4
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}

_HF: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_ref(path: str, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    key = (path, tuple(prompt), max_new)
    if key not in _HF:
        _HF[key] = hf_greedy(path, prompt, max_new)
    return _HF[key]


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]  # ids < 5 are special (eos, ...)


def diverge(rng: random.Random, prefix: list[int], avoid: int, n: int, vocab: int) -> list[int]:
    """``prefix`` + n fresh tokens, the first of which differs from ``avoid``."""
    first = rng.randrange(5, vocab)
    while first == avoid:
        first = rng.randrange(5, vocab)
    return prefix + [first] + rand_ids(rng, n - 1, vocab)


def gen(engine, prompts: list[list[int]], params: dict | None = None, **kw) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params or GREEDY,
                           return_logprob=True, **kw)


def logprobs(res: dict) -> list[float]:
    return [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]


def cached(res: dict) -> int:
    return res["meta_info"]["cached_tokens"]


def stat(engine, name: str) -> int:
    return engine.get_server_info()["stats"][name]


def assert_same(on: list[dict], off: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["output_ids"] == b["output_ids"], f"request {i}: cache on/off outputs differ"
        err = max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b), strict=True))
        assert err <= LOGPROB_TOL, f"request {i}: logprob differs by {err:.2e} with the cache on"


def assert_hf(path: str, prompts: list[list[int]], results: list[dict],
              logprob_check: bool = False) -> None:
    for i, (p, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == hf_ref(path, p), f"request {i} differs from transformers"
        if logprob_check:
            tf = hf_logprobs(path, p + res["output_ids"])[len(p):].tolist()
            err = max(abs(a - b) for a, b in zip(logprobs(res), tf, strict=True))
            assert err <= LOGPROB_TOL, f"request {i}: logprob error {err:.2e} vs transformers"


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args, **kwargs)))
    t.start()
    return t, box


# ---- parity: shared-prefix, partially overlapping and disjoint prompts, in waves ---------------

def _wave_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(1)
    base = rand_ids(rng, 96, vocab)
    tails = [rand_ids(rng, 20, vocab) for _ in range(3)]
    p0 = base + tails[0]
    wave1 = [p0, rand_ids(rng, 70, vocab)]
    wave2 = [
        base + tails[1],                                    # shared 96-token prefix
        base + tails[2],
        diverge(rng, base[:50], base[50], 60, vocab),       # partial overlap (50 tokens)
        diverge(rng, p0[:110], p0[110], 9, vocab),          # overlaps inside a cached node
        p0,                                                 # exact repeat
        rand_ids(rng, 130, vocab),                          # disjoint
    ]
    return wave1, wave2


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_on_off_parity_in_waves(page_size, qwen2_path, make_engine):
    on = make_engine(qwen2_path, page_size=page_size)
    off = make_engine(qwen2_path, page_size=page_size, disable_radix_cache=True)
    wave1, wave2 = _wave_prompts(on.tm.vocab_size)
    res_on = gen(on, wave1) + gen(on, wave2)
    on.check_integrity()
    res_off = gen(off, wave1) + gen(off, wave2)
    assert_same(res_on, res_off)
    assert_hf(qwen2_path, wave1 + wave2, res_on)
    assert all(cached(r) == 0 for r in res_off)
    assert [cached(r) > 0 for r in res_on[len(wave1):]] == [True] * 5 + [False]
    # a repeat reuses all but the last token (its logits are needed), rounded down to a page
    assert cached(res_on[len(wave1) + 4]) == (len(wave1[0]) - 1) // page_size * page_size


@pytest.mark.parametrize("page_size,repeat,shared", [(1, 99, 40), (16, 96, 32)])
def test_cached_tokens_is_the_reused_length(page_size, repeat, shared, qwen2_path, make_engine):
    engine = make_engine(qwen2_path, page_size=page_size)
    rng = random.Random(2)
    vocab = engine.tm.vocab_size
    p = rand_ids(rng, 100, vocab)
    q = diverge(rng, p[:40], p[40], 50, vocab)
    first, second = gen(engine, [p])[0], gen(engine, [p])[0]
    third = gen(engine, [q])[0]
    assert (cached(first), cached(second), cached(third)) == (0, repeat, shared)
    assert first["output_ids"] == second["output_ids"] == hf_ref(qwen2_path, p)
    assert third["output_ids"] == hf_ref(qwen2_path, q)
    assert_same([second], [first])
    assert stat(engine, "cached_tokens") == repeat + shared


# ---- GRPO: n samples of one prompt prefill it once --------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_n_samples_prefill_the_prompt_once(page_size, qwen2_path, make_engine):
    engine = make_engine(qwen2_path, page_size=page_size)
    rng = random.Random(3)
    vocab = engine.tm.vocab_size
    fresh, batch, ext = rand_ids(rng, 150, vocab), rand_ids(rng, 140, vocab), rand_ids(rng, 60, vocab)
    ref_fresh = hf_ref(qwen2_path, fresh)

    before = stat(engine, "prefill_tokens")
    outs = gen(engine, [fresh], {**GREEDY, "n": 8})
    computed = stat(engine, "prefill_tokens") - before
    assert len(outs) == 8 and all(o["output_ids"] == ref_fresh for o in outs)
    assert len(fresh) <= computed <= len(fresh) + 7 * page_size, computed

    before = stat(engine, "prefill_tokens")        # 8 identical requests in one batch call
    outs = gen(engine, [batch] * 8)
    computed = stat(engine, "prefill_tokens") - before
    assert all(o["output_ids"] == hf_ref(qwen2_path, batch) for o in outs)
    assert len(batch) <= computed <= len(batch) + 7 * page_size, computed

    # a prompt extending a cached one: the uncached tail is computed once too
    longer = fresh + ext
    before = stat(engine, "prefill_tokens")
    outs = gen(engine, [longer], {**GREEDY, "n": 8})
    computed = stat(engine, "prefill_tokens") - before
    hit = cached(outs[0])
    assert hit >= len(fresh) // page_size * page_size - page_size
    assert all(o["output_ids"] == hf_ref(qwen2_path, longer) for o in outs)
    assert computed <= len(longer) - hit + 7 * page_size, (computed, hit)


def test_siblings_wait_for_a_chunked_prompt_instead_of_computing_its_last_chunk(
        qwen2_path, make_engine):
    # the prompt is prefilled in two chunks (100 + 50 tokens); the step that computes its last
    # 50 has budget left, and the siblings already match the first 100: one of them admitted
    # then would compute the same 50 tokens beside it instead of finding them cached a step on
    engine = make_engine(qwen2_path, chunked_prefill_size=100)
    rng = random.Random(5)
    prompt = rand_ids(rng, 150, engine.tm.vocab_size)
    before = stat(engine, "prefill_tokens")
    outs = gen(engine, [prompt], {**GREEDY, "n": 8})
    computed = stat(engine, "prefill_tokens") - before
    assert all(o["output_ids"] == hf_ref(qwen2_path, prompt) for o in outs)
    assert computed == len(prompt) + 7, computed   # each sibling recomputes its last token only


# ---- eviction under a KV budget much smaller than the working set ----------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_eviction_keeps_outputs_correct(page_size, qwen2_path, make_engine, monkeypatch):
    evictions = {"total": 0, "while_locked": 0}
    real_evict = RadixCache.evict

    def counting_evict(self, num_tokens: int) -> int:  # the thread scheduler shares our process
        evictions["total"] += 1
        evictions["while_locked"] += self.protected_size() > 0
        return real_evict(self, num_tokens)

    monkeypatch.setattr(RadixCache, "evict", counting_evict)
    engine = make_engine(qwen2_path, max_total_tokens=400, page_size=page_size)
    rng = random.Random(4)
    vocab = engine.tm.vocab_size
    seq = [rand_ids(rng, 150, vocab) for _ in range(5)]
    for p in seq:                                   # one at a time: each evicts older ones
        res = gen(engine, [p])[0]
        assert res["output_ids"] == hf_ref(qwen2_path, p)
        engine.check_integrity()
    assert engine.get_server_info()["kv_cached_tokens"] <= 400
    again = gen(engine, [seq[0]])[0]                # least recently used: evicted long ago
    assert cached(again) == 0 and again["output_ids"] == hf_ref(qwen2_path, seq[0])
    # interleaved: groups sharing a locked 100-token prefix run while distinct prompts evict
    shared = rand_ids(rng, 100, vocab)
    mixed = [shared + rand_ids(rng, 50, vocab) for _ in range(3)]
    mixed += [rand_ids(rng, 150, vocab) for _ in range(3)]
    order = [0, 3, 1, 4, 2, 5]
    mixed = [mixed[i] for i in order]
    locked_before = evictions["while_locked"]
    res = gen(engine, mixed)
    assert_hf(qwen2_path, mixed, res, logprob_check=True)
    assert evictions["while_locked"] > locked_before   # evicted around running requests' nodes
    assert [cached(res[i]) > 0 for i in (2, 4)] == [True, True]  # group siblings share the prefix
    engine.check_integrity()
    # the same again from staggered threads, so requests join a running batch mid-eviction
    results: list = [None] * len(mixed)

    def worker(i: int) -> None:
        time.sleep(0.02 * i)
        results[i] = gen(engine, [mixed[i]])[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(mixed))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_same(results, res)
    engine.check_integrity()


# ---- flush_cache -----------------------------------------------------------------------------

def test_flush_cache_busy_then_idle(qwen2_path, make_engine):
    engine = make_engine(qwen2_path)
    rng = random.Random(5)
    prompt = rand_ids(rng, 80, engine.tm.vocab_size)
    long_params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    t, box = in_thread(engine.generate, input_ids=prompt, sampling_params=long_params,
                       return_logprob=True)
    wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 1)
    busy = engine.tm.call("flush_cache")
    assert not busy.success and busy.status == 409
    assert "in flight" in busy.message and "retry" in busy.message
    engine.pause_generation("in_place")   # still holding its KV, it cannot finish meanwhile
    assert engine.flush_cache() is False
    engine.continue_generation()
    t.join()
    out = box["out"]
    assert out["output_ids"] == hf_ref(qwen2_path, prompt, 48)  # serving went on, unharmed
    assert out["meta_info"]["finish_reason"]["type"] == "length"

    assert cached(gen(engine, [prompt])[0]) == len(prompt) - 1
    assert engine.flush_cache() is True
    info = engine.get_server_info()
    assert info["kv_cached_tokens"] == 0 and info["kv_free_tokens"] == info["max_total_num_tokens"]
    res = gen(engine, [prompt])[0]
    assert cached(res) == 0 and res["output_ids"] == hf_ref(qwen2_path, prompt)


# ---- schedule policies -----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_schedule_policy_order_and_correctness(policy, qwen2_path, make_engine):
    """max_running_requests=1: while a long request runs, queue two misses then a cache hit.
    lpm admits the hit first; fcfs keeps arrival order. Both give transformers' outputs."""
    engine = make_engine(qwen2_path, schedule_policy=policy, max_running_requests=1)
    rng = random.Random(6)
    vocab = engine.tm.vocab_size
    hot = rand_ids(rng, 120, vocab)
    gen(engine, [hot])                              # now cached
    blocker = rand_ids(rng, 30, vocab)
    t, box = in_thread(engine.generate, input_ids=blocker,
                       sampling_params={"temperature": 0, "max_new_tokens": 64,
                                        "ignore_eos": True})
    wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 1)
    queued = [rand_ids(rng, 60, vocab), rand_ids(rng, 60, vocab), hot[:100] + [7] * 10]
    res = gen(engine, queued)
    t.join()
    assert engine.get_server_info()["num_waiting_reqs"] == 0
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert_hf(qwen2_path, queued, res)
    assert cached(res[2]) == 100 and cached(res[0]) == cached(res[1]) == 0
    # every one was queued behind the blocker at the same time: latency gives completion order
    finish = sorted(range(3), key=lambda i: res[i]["meta_info"]["e2e_latency"])
    assert finish == ([2, 0, 1] if policy == "lpm" else [0, 1, 2])


# ---- namespaces ------------------------------------------------------------------------------

def test_extra_key_isolates_the_cache(qwen2_path, make_engine):
    engine = make_engine(qwen2_path)
    prompt = rand_ids(random.Random(7), 64, engine.tm.vocab_size)
    a = gen(engine, [prompt], extra_key="lora-a")[0]
    b = gen(engine, [prompt], extra_key="lora-b")[0]
    none = gen(engine, [prompt])[0]
    a2 = gen(engine, [prompt], extra_key="lora-a")[0]
    assert [cached(r) for r in (a, b, none, a2)] == [0, 0, 0, 63]
    assert a["output_ids"] == b["output_ids"] == none["output_ids"] == a2["output_ids"]
    assert a["output_ids"] == hf_ref(qwen2_path, prompt)
