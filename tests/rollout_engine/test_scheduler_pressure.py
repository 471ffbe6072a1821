"""The scheduler under KV pressure, and logprob / stop-string edge cases.

Each test pins a failure mode (a crash, a hang, a wrong result). Calls that could hang run in a
thread joined with a deadline, so they fail instead. The
``make_engine`` fixture proves the KV invariant when each test ends; the tests that drive a
``Scheduler`` directly check it themselves.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.policy import NewTokenRatio
from rollout_engine.scheduler.scheduler import Scheduler
from tests.rollout_engine.hf_reference import hf_logprobs

DEADLINE = 120.0   # seconds; every call here takes well under 10 on two CPU cores
LOGPROB_TOL = 1e-4
VOCAB = 512


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(n)]  # ids < 5 are special (eos, ...)


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def within(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` in a thread: its value, or its exception re-raised; fails if it hangs."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), f"{what} did not finish within {DEADLINE:.0f} s (hung)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def wait_until(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def generate_together(engine, prompts: list[list[int]], params: dict[str, Any]) -> list[dict]:
    """One generate call whose requests all reach the scheduler before it schedules any of
    them (submitted while paused), so they meet in the same admission round."""
    engine.pause_generation(mode="in_place")
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(
        value=within(lambda: engine.generate(input_ids=prompts, sampling_params=params),
                     "generate")), daemon=True)
    t.start()
    wait_until(lambda: engine.get_server_info()["num_waiting_reqs"] == len(prompts))
    engine.continue_generation()
    t.join(DEADLINE + 5)
    assert "value" in box, "generate failed (the scheduler died?)"
    return box["value"]


def stats(engine) -> dict[str, int]:
    return engine.get_server_info()["stats"]


# -- 1. a prefix match evicted by an earlier admission in the same round ------------------------

def _evicted_match_workload(policy: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts to cache first, the batch). Admitting the batch's first request reserves KV by
    evicting the unlocked node that its second request's match points to."""
    rng = random.Random(10)
    if policy == "fcfs":
        cached = rand_ids(rng, 100)
        return [cached], [rand_ids(rng, 150), cached + rand_ids(rng, 10)]
    # lpm admits the longest match first: it needs the evictable node the shorter match holds
    long, short = rand_ids(rng, 100), rand_ids(rng, 40)
    return [long, short], [long + rand_ids(rng, 80), short + rand_ids(rng, 10)]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_prefix_match_evicted_by_an_earlier_admission_is_matched_again(
        policy, qwen2_path, qwen2_engine, make_engine):
    engine = make_engine(qwen2_path, max_total_tokens=200, schedule_policy=policy)
    first, batch = _evicted_match_workload(policy)
    for p in first:
        engine.generate(input_ids=p, sampling_params=greedy(4))
    assert engine.get_server_info()["kv_cached_tokens"] >= sum(len(p) for p in first)
    results = generate_together(engine, batch, greedy(4))
    assert engine.tm.dead is None, f"the scheduler died: {engine.tm.dead}"
    expected = qwen2_engine.generate(input_ids=batch, sampling_params=greedy(4))
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in expected]
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length", "length"]


# -- 2. requests bigger than the KV pool ----------------------------------------------------------

def test_request_bigger_than_the_pool_is_refused_at_submit(qwen2_path, make_engine):
    engine = make_engine(qwen2_path, max_total_tokens=200)
    rng = random.Random(2)
    with pytest.raises(ValueError, match=r"input_ids: .*KV pool \(200 tokens"):
        within(lambda: engine.generate(input_ids=rand_ids(rng, 250),
                                       sampling_params=greedy(1)), "a 250-token prompt")
    with pytest.raises(ValueError, match=r"max_new_tokens: .*KV pool \(200 tokens"):
        within(lambda: engine.generate(input_ids=rand_ids(rng, 150),
                                       sampling_params=greedy(51)), "150 + 51 tokens")
    # HTTP: the same refusal is a 400 with the message
    body = {"input_ids": rand_ids(rng, 150), "sampling_params": greedy(60)}
    resp = TestClient(engine_app(engine)).post("/generate", json=body)
    assert resp.status_code == 400
    assert "KV pool (200 tokens" in resp.json()["error"]["message"]
    # exactly the pool fits, and runs to the end alone
    out = within(lambda: engine.generate(input_ids=rand_ids(rng, 150),
                                         sampling_params=greedy(50)), "150 + 50 tokens")
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 50}


def engine_app(engine):
    from rollout_engine.entrypoints.http_server import create_app

    return create_app(engine)


def _scheduler(path: str, **flags: Any) -> Scheduler:
    return Scheduler(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                  scheduler_mode="thread", **flags))


def _req(rid: str, ids: list[int], max_new: int) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=ids, seed=0,
                       sampling_params=SamplingParams.from_dict(greedy(max_new)))


def _run_until_done(s: Scheduler, rids: set[str], max_steps: int = 2000) -> dict[str, Any]:
    """Step the scheduler until every rid has a final output; fails if that never happens."""
    done: dict[str, Any] = {}
    for _ in range(max_steps):
        for out in s.step().outputs:
            if out.finished_reason is not None:
                done[out.rid] = out
        if rids <= done.keys():
            return done
    raise AssertionError(f"requests {sorted(rids - done.keys())} never finished "
                         f"({s.stats['num_retractions']} retractions)")


def test_lone_request_outgrowing_the_pool_finishes_with_abort(qwen2_path, qwen2_engine):
    """A request that reaches the scheduler without the frontend's check, alone in the pool:
    once its KV fills the pool it ends with a clear abort, instead of retracting itself and
    recomputing forever."""
    s = _scheduler(qwen2_path, max_total_tokens=64)
    prompt = rand_ids(random.Random(3), 40)
    s.handle(_req("big", prompt, 100))
    out = _run_until_done(s, {"big"})["big"]
    assert out.finished_reason["type"] == "abort"
    assert "KV pool's 64" in out.finished_reason["message"]
    assert s.stats["num_retractions"] == 0
    # it ran until the pool was full (64 KV tokens: the prompt + 24 outputs, then one more
    # sampled token) and what it produced is the uncontended greedy output
    assert len(out.token_ids) == 64 - 40 + 1
    ref = qwen2_engine.generate(input_ids=prompt, sampling_params=greedy(25))
    assert out.token_ids == ref["output_ids"]
    assert s.check_integrity()["idle"]


def test_waiting_request_that_can_never_fit_does_not_block_the_queue(qwen2_path):
    s = _scheduler(qwen2_path, max_total_tokens=64)
    rng = random.Random(4)
    s.handle(_req("huge", rand_ids(rng, 80), 4))
    s.handle(_req("small", rand_ids(rng, 10), 4))
    done = _run_until_done(s, {"huge", "small"})
    assert done["huge"].finished_reason["type"] == "abort"
    assert "KV pool holds 64" in done["huge"].finished_reason["message"]
    assert done["small"].finished_reason == {"type": "length", "length": 4}
    assert s.check_integrity()["idle"]


# -- 3. retraction thrash -------------------------------------------------------------------------

def test_new_token_ratio_decays_and_jumps_back_after_a_retraction():
    ratio = NewTokenRatio(init=0.7, min=0.1, decay_steps=600)
    for _ in range(300):
        ratio.decay()
    assert ratio.value == pytest.approx(0.4)
    for _ in range(1000):
        ratio.decay()
    assert ratio.value == pytest.approx(0.1)
    survivors = [_FakeReq(outputs=150, max_new=200), _FakeReq(outputs=170, max_new=200)]
    ratio.after_retract(survivors)   # (150 + 170 + 2 * 20) / 400
    assert ratio.value == pytest.approx(0.9)
    ratio.after_retract([_FakeReq(outputs=400, max_new=400)])
    assert ratio.value == 1.0
    ratio.reset()
    assert ratio.value == 0.7


class _FakeReq:
    def __init__(self, outputs: int, max_new: int) -> None:
        self.output_ids = [0] * outputs
        self.params = SamplingParams(max_new_tokens=max_new)


def test_long_rollouts_in_a_small_pool_do_not_thrash(qwen2_path, qwen2_engine, make_engine):
    """48 rollouts of 200 tokens in a 1024-token pool. The fixed 0.5 ratio retracted 17 times and
    recomputed 2436 prefill tokens (3.2x the prompts); the adaptive ratio retracts 6 times and
    recomputes 938. Outputs equal the uncontended engine's."""
    engine = make_engine(qwen2_path, max_total_tokens=1024)
    rng = random.Random(0)
    prompts = [rand_ids(rng, 16) for _ in range(48)]
    results = generate_together(engine, prompts, greedy(200))
    st = stats(engine)
    recomputed = st["prefill_tokens"] - (st["prompt_tokens"] - st["cached_tokens"])
    assert st["num_retractions"] > 0, "the workload no longer puts the pool under pressure"
    assert st["num_retractions"] <= 9, f"{st['num_retractions']} retractions"
    assert recomputed <= 2 * st["prompt_tokens"], f"{recomputed} prefill tokens recomputed"
    expected = qwen2_engine.generate(input_ids=prompts, sampling_params=greedy(200))
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in expected]


def test_chunked_request_future_tokens_are_reserved(qwen2_path):
    """A request admitted while another finishes its chunked prefill must leave room for the
    chunked one's decode too (0.7 x 100 tokens here), not only for the running requests'."""
    s = _scheduler(qwen2_path, max_total_tokens=256, chunked_prefill_size=32)
    rng = random.Random(6)
    s.handle(_req("chunked", rand_ids(rng, 100), 100))
    for _ in range(3):          # chunks of 32: 96 of its 100 prompt tokens are computed
        s.step()
    assert s.chunked is not None and s.chunked.rid == "chunked"
    s.handle(_req("next", rand_ids(rng, 60), 100))
    s.step()                    # the last chunk; 60 + 70 (own) + 70 (chunked's) > 156 free
    assert [r.rid for r in s.running] == ["chunked"]
    assert [r.rid for r in s.waiting] == ["next"]
    done = _run_until_done(s, {"chunked", "next"})
    assert all(d.finished_reason["type"] == "length" for d in done.values())
    assert s.stats["num_retractions"] == 0
    assert s.check_integrity()["idle"]


# -- 4. top_k = 1 keeps the request's temperature for logprobs -------------------------------------

@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_top_k_1_logprobs_use_the_request_temperature(temperature, qwen2_path, qwen2_engine):
    """Every logprob is log_softmax(logits / T), T the request's (T = 0 scores raw logits);
    top_k = 1 samples greedily but must not change T."""
    prompt = rand_ids(random.Random(5), 12)
    params = {"temperature": temperature, "top_k": 1, "max_new_tokens": 6, "ignore_eos": True}
    res = qwen2_engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True,
                                logprob_start_len=0)
    greedy_ids = qwen2_engine.generate(input_ids=prompt, sampling_params=greedy(6))["output_ids"]
    assert res["output_ids"] == greedy_ids
    ref = hf_logprobs(qwen2_path, prompt + res["output_ids"], temperature=temperature or 1.0)
    meta = res["meta_info"]
    got_out = [lp for lp, _, _ in meta["output_token_logprobs"]]
    got_in = [lp for lp, _, _ in meta["input_token_logprobs"]][1:]  # the first has no context
    err_out = max(abs(a - b) for a, b in zip(got_out, ref[len(prompt):].tolist(), strict=True))
    err_in = max(abs(a - b) for a, b in zip(got_in, ref[1:len(prompt)].tolist(), strict=True))
    assert err_out <= LOGPROB_TOL, f"output logprobs off by {err_out:.2e} at T={temperature}"
    assert err_in <= LOGPROB_TOL, f"prompt logprobs off by {err_in:.2e} at T={temperature}"


# -- 5. a stop string skipped below min_new_tokens stays in the text -------------------------------

STOP_N = 40


def _occurrences(tokenizer, ids: list[int], s: str) -> list[tuple[int, int]]:
    """(start character, output count at which it is complete) of each occurrence of ``s`` in
    ``decode(ids)``; [] when some prefix of ``ids`` does not decode to a prefix of the text."""
    text = tokenizer.decode(ids)
    done = [len(tokenizer.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids) + 1)]
    if any(not text.startswith(tokenizer.decode(ids[:k]).rstrip("\ufffd"))
           for k in range(len(ids) + 1)):
        return []
    found, i = [], text.find(s)
    while i >= 0:
        found.append((i, next(k for k in range(1, len(ids) + 1) if done[k] >= i + len(s))))
        i = text.find(s, i + 1)
    return found


def _stop_case(engine, count: int) -> tuple[str, list[int], str, str, list[tuple[int, int]]]:
    """A prompt, its greedy output ids and text, and a stop string occurring ``count`` times in
    it, each completed by a different token, the first from the second token on."""
    tok = engine.tokenizer
    for prompt in ("Once upon a time", "The quick brown fox", "hello world", "a b c d e f"):
        res = engine.generate(prompt, greedy(STOP_N))
        ids, text = res["output_ids"], res["text"]
        for length in (3, 4, 2):
            for i in range(len(text) - length):
                s = text[i:i + length]
                if "\ufffd" in s or not s.strip():
                    continue
                occ = _occurrences(tok, ids, s)
                steps = [n for _, n in occ]
                if (len(occ) == count and steps[0] >= 2 and steps[-1] < STOP_N
                        and len(set(steps)) == count):
                    return prompt, ids, text, s, occ
    raise AssertionError(f"no stop string occurring {count} times in the tiny model's outputs")


def test_stop_string_skipped_below_min_new_tokens_stays_in_the_text(qwen2_engine):
    prompt, ids, text, s, [(_, n1)] = _stop_case(qwen2_engine, count=1)
    params = {**greedy(STOP_N), "stop": [s], "min_new_tokens": n1 + 1}
    res = qwen2_engine.generate(prompt, params)
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert res["output_ids"] == ids
    assert res["text"] == text, f"stop string {s!r} completed by token {n1} was trimmed"
    chunks = list(qwen2_engine.generate(prompt, params, stream=True))
    assert chunks[-1]["text"] == text   # cumulative, as SGLang streams


def test_stop_string_after_min_new_tokens_stops_at_that_occurrence(qwen2_engine):
    """The first occurrence is skipped (below min_new_tokens); the second stops generation,
    and the text is cut there, not at the first."""
    prompt, ids, text, s, [(_, n1), (i2, n2)] = _stop_case(qwen2_engine, count=2)
    params = {**greedy(STOP_N), "stop": [s], "min_new_tokens": n1 + 1}
    res = qwen2_engine.generate(prompt, params)
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
    assert res["output_ids"] == ids[:n2]
    assert res["text"] == text[:i2]
