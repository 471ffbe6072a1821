"""Rollout routing replay (R3): the experts every token was routed to, returned as SGLang does.

Every check decodes ``meta_info["routed_experts"]`` as slime does (base64 int32, reshaped to
``[len(prompt + output) - 1 - start, num_hidden_layers, top_k]``) and compares it with the experts
transformers' routers pick on the same whole sequence (``hf_routed_experts``; the top-k compared
as sets, as near-equal router probabilities may order two experts either way). The paths
that move KV around are each taken and proven taken: a radix hit (``cached_tokens``), chunked
prefill (a prompt longer than the chunk), retraction by a crowd (``num_retractions``), a pause
that retracts, aborts or holds a request mid-way, speculative verify forwards (accepted
proposals), sleep and wake of the KV cache, data-parallel replicas and (slow) tensor parallelism.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollout_engine.config import EngineConfig
from tests.rollout_engine.engines import app_client, thread_engine
from tests.rollout_engine.hf_reference import hf_routed_experts

POOL_TOKENS = 160
CHUNK = 16
FLAGS = {"enable_return_routed_experts": True, "chunked_prefill_size": CHUNK,
         "max_total_tokens": POOL_TOKENS, "debug_integrity": True}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPT = [11 + 7 * i % 480 for i in range(40)]   # longer than a chunk
# a crowd (tests/rollout_engine/test_chaos.py): admission's estimate fits all of them, their
# full lengths (5 x 44 > POOL_TOKENS) do not, so decoding must retract
CROWD, CROWD_PROMPT, CROWD_NEW = 5, 4, 40


@pytest.fixture(scope="module")
def moe_path() -> str:
    from rollout_engine.testing.tiny_moe import tiny_moe_path

    return str(tiny_moe_path("qwen3_moe"))


@pytest.fixture(scope="module")
def engine(moe_path: str) -> Iterator[Any]:
    yield from thread_engine(moe_path, **FLAGS)


def _shape(path: str) -> tuple[int, int]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg["num_experts_per_tok"]


def routed(path: str, out: dict[str, Any]) -> torch.Tensor:
    """``meta_info["routed_experts"]`` decoded as slime does."""
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    num_layers, top_k = _shape(path)
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k).copy())


def assert_hf_routing(path: str, prompt: list[int], out: dict[str, Any], start: int = 0) -> None:
    """The returned rows are transformers' routing of ``prompt + output`` from ``start``."""
    got = routed(path, out)
    want = hf_routed_experts(path, prompt + out["output_ids"])[start:]
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


def _stats(engine: Any) -> dict[str, int]:
    return engine.get_server_info()["stats"]


# -- the record itself ------------------------------------------------------------------------
def test_prompt_and_output_rows_equal_transformers_routing(engine: Any, moe_path: str) -> None:
    passes = _stats(engine)["forward_passes"]
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_routed_experts=True)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    assert _stats(engine)["forward_passes"] - passes >= len(PROMPT) // CHUNK + 7   # chunked
    assert_hf_routing(moe_path, PROMPT, out)
    assert routed(moe_path, out).shape[0] == len(PROMPT) + len(out["output_ids"]) - 1


def test_a_dense_layer_is_minus_one(make_engine: Any) -> None:
    from rollout_engine.testing.tiny_moe import tiny_moe_path

    path = str(tiny_moe_path("qwen2_moe", num_layers=3, mlp_only_layers=(1,)))
    eng = make_engine(path, enable_return_routed_experts=True)
    out = eng.generate(input_ids=PROMPT[:20], sampling_params=GREEDY, return_routed_experts=True)
    rows = routed(path, out)
    assert (rows[:, 1] == -1).all() and (rows[:, [0, 2]] >= 0).all()
    assert_hf_routing(path, PROMPT[:20], out)


def test_requests_that_do_not_ask_get_no_key(engine: Any) -> None:
    outs = engine.generate(input_ids=[PROMPT[:10], PROMPT[5:15]], sampling_params=GREEDY,
                           return_routed_experts=[True, False])
    assert "routed_experts" in outs[0]["meta_info"]
    assert "routed_experts" not in outs[1]["meta_info"]


def test_server_info_reports_the_memory_per_token(engine: Any, qwen2_engine: Any) -> None:
    # 2 MoE layers x top-2 experts, one byte each (8 experts fit in uint8)
    assert engine.get_server_info()["routed_experts_bytes_per_token"] == 4
    assert engine.get_server_info()["enable_return_routed_experts"] is True
    assert qwen2_engine.get_server_info()["routed_experts_bytes_per_token"] == 0


# -- KV that moves ------------------------------------------------------------------------------
def test_a_radix_hit_reads_the_shared_prefix_rows(engine: Any, moe_path: str) -> None:
    first = PROMPT + [300, 301]
    engine.generate(input_ids=first, sampling_params=GREEDY)
    second = PROMPT + [400, 401, 402]
    out = engine.generate(input_ids=second, sampling_params=GREEDY, return_routed_experts=True)
    assert out["meta_info"]["cached_tokens"] >= len(PROMPT) // 2
    assert_hf_routing(moe_path, second, out)


def test_retracted_requests_are_recomputed_into_rows_that_still_match(engine: Any,
                                                                      moe_path: str) -> None:
    before = _stats(engine)["num_retractions"]
    params = {"max_new_tokens": CROWD_NEW, "temperature": 0.0, "ignore_eos": True}
    prompts = [[400 + 10 * i + j for j in range(CROWD_PROMPT)] for i in range(CROWD)]
    engine.pause_generation("in_place")   # they arrive together: one admission for all
    states = [engine._submit(None, params, p, False, 0, -1, False, None, None,
                             return_routed_experts=True)[0][0] for p in prompts]
    engine.continue_generation()
    outs = [engine.tm.wait(st, timeout=60) for st in states]
    assert _stats(engine)["num_retractions"] > before
    for prompt, out in zip(prompts, outs):
        assert_hf_routing(moe_path, prompt, out)


def _pause_mid_request(engine: Any, mode: str) -> tuple[list[int], list[dict[str, Any]]]:
    """A streamed request paused (``mode``) once it has output, then continued; its chunks."""
    prompt = PROMPT[:20]
    params = {"max_new_tokens": POOL_TOKENS - 40, "temperature": 0.0, "ignore_eos": True}
    stream = engine.generate(input_ids=prompt, sampling_params=params, stream=True,
                             return_routed_experts=True)
    chunks = [next(stream)]
    engine.pause_generation(mode)
    engine.continue_generation()
    chunks.extend(stream)
    return prompt, chunks


def test_pause_retract_then_continue_mid_request(engine: Any, moe_path: str) -> None:
    before = _stats(engine)["num_retractions"]
    prompt, chunks = _pause_mid_request(engine, "retract")
    assert _stats(engine)["num_retractions"] == before + 1   # it was running when paused
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert_hf_routing(moe_path, prompt, last)


def test_pause_in_place_then_continue_mid_request(engine: Any, moe_path: str) -> None:
    before = _stats(engine)["num_retractions"]
    prompt, chunks = _pause_mid_request(engine, "in_place")
    assert _stats(engine)["num_retractions"] == before
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert_hf_routing(moe_path, prompt, chunks[-1])


def test_an_aborted_running_request_returns_its_rows(engine: Any, moe_path: str) -> None:
    prompt, chunks = _pause_mid_request(engine, "abort")
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < POOL_TOKENS - 40
    assert_hf_routing(moe_path, prompt, last)


def test_a_request_aborted_while_queued_has_no_rows(engine: Any) -> None:
    engine.pause_generation("in_place")
    try:
        (state,), _ = engine._submit(None, GREEDY, PROMPT[:8], False, 0, -1, False,
                                     "queued-then-aborted", None, return_routed_experts=True)
        engine.abort_request("queued-then-aborted")
        out = engine.tm.wait(state, timeout=30)
    finally:
        engine.continue_generation()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "routed_experts" not in out["meta_info"]


def test_the_record_sleeps_and_wakes_with_the_kv_cache(engine: Any, moe_path: str) -> None:
    held = engine.get_server_info()["routed_experts_bytes"]
    assert held == 4 * (POOL_TOKENS + 1)   # a row per slot, the padding slot's included
    engine.release_memory_occupation(["kv_cache"])
    assert engine.get_server_info()["routed_experts_bytes"] == 0
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.get_server_info()["routed_experts_bytes"] == held
    out = engine.generate(input_ids=PROMPT[:20], sampling_params=GREEDY,
                          return_routed_experts=True)
    assert_hf_routing(moe_path, PROMPT[:20], out)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_speculative_verify_forwards_write_the_accepted_rows(make_engine: Any, moe_path: str,
                                                            algorithm: str) -> None:
    draft = {"speculative_draft_model_path": moe_path} if algorithm == "STANDALONE" else {}
    eng = make_engine(moe_path, enable_return_routed_experts=True, **draft,
                      speculative_algorithm=algorithm, speculative_num_draft_tokens=5)
    passage = [40 + 13 * i % 400 for i in range(12)]
    prompt = [7, 8, 9] + passage + [7] + passage[:6]
    out = eng.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True},
        return_routed_experts=True)
    assert out["meta_info"]["spec_accept_token_num"] > 0
    assert_hf_routing(moe_path, prompt, out)


def test_data_parallel_replicas_each_record_their_own(moe_path: str) -> None:
    prompts = [PROMPT[i:i + 16] for i in range(0, 24, 6)]
    for eng in thread_engine(moe_path, enable_return_routed_experts=True, dp_size=2):
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True)
        replicas = eng.get_server_info()["dp_results"]
        assert [r["stats"]["forward_passes"] > 0 for r in replicas] == [True, True]
        for prompt, out in zip(prompts, outs):
            assert_hf_routing(moe_path, prompt, out)


@pytest.mark.slow
def test_tensor_parallel_rank_zero_records(moe_path: str) -> None:
    from rollout_engine import Engine

    with Engine(model_path=moe_path, dtype="float32", device="cpu", tp_size=2,
                enable_return_routed_experts=True, max_total_tokens=1024) as eng:
        prompts = [PROMPT[:30], PROMPT[:20] + [500, 501]]   # the second one a radix hit
        outs = [eng.generate(input_ids=p, sampling_params=GREEDY, return_routed_experts=True)
                for p in prompts]
        assert outs[1]["meta_info"]["cached_tokens"] > 0
        for prompt, out in zip(prompts, outs):
            assert_hf_routing(moe_path, prompt, out)
        assert eng.get_server_info()["routed_experts_bytes_per_token"] == 4
        eng.check_integrity()


# -- the request fields -----------------------------------------------------------------------
def test_start_len_returns_the_tail_rows(engine: Any, moe_path: str) -> None:
    prompt = PROMPT[:24]
    for start in (5, len(prompt)):
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY,
                              return_routed_experts=True, routed_experts_start_len=start)
        assert routed(moe_path, out).shape[0] == len(prompt) + len(out["output_ids"]) - 1 - start
        assert_hf_routing(moe_path, prompt, out, start=start)
    with pytest.raises(ValueError, match="routed_experts_start_len: 25 is higher than"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, return_routed_experts=True,
                        routed_experts_start_len=len(prompt) + 1)
    nothing_new = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                                  return_routed_experts=True)
    assert_hf_routing(moe_path, prompt, nothing_new)   # the prompt's tokens but the last
    with pytest.raises(ValueError, match="routed_experts_start_len: must be >= 0"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, return_routed_experts=True,
                        routed_experts_start_len=-1)


def test_n_samples_each_carry_their_own_rows(engine: Any, moe_path: str) -> None:
    prompt = PROMPT[:12]
    outs = engine.generate(input_ids=prompt, return_routed_experts=True, sampling_params={
        "n": 3, "max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 3})
    assert len({tuple(o["output_ids"]) for o in outs}) > 1   # different samples
    for out in outs:
        assert_hf_routing(moe_path, prompt, out)


def test_a_stream_carries_the_rows_in_its_last_chunk(engine: Any, moe_path: str) -> None:
    chunks = list(engine.generate(input_ids=PROMPT[:16], sampling_params=GREEDY, stream=True,
                                  return_routed_experts=True))
    assert len(chunks) > 1
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    assert_hf_routing(moe_path, PROMPT[:16], chunks[-1])


def test_http_generate(engine: Any, moe_path: str) -> None:
    for client in app_client(engine):
        r = client.post("/generate", json={
            "input_ids": [PROMPT[:10], PROMPT[:14]], "sampling_params": GREEDY,
            "return_routed_experts": [False, True], "routed_experts_start_len": [0, 3]})
        assert r.status_code == 200, r.text
        first, second = r.json()
        assert "routed_experts" not in first["meta_info"]
        assert_hf_routing(moe_path, PROMPT[:14], second, start=3)
        bad = client.post("/generate", json={"input_ids": PROMPT[:4], "sampling_params": GREEDY,
                                             "return_routed_experts": True,
                                             "routed_experts_start_len": 9})
        assert bad.status_code == 400
        assert "routed_experts_start_len" in bad.json()["error"]["message"]


def test_openai_completions_carry_sglext(engine: Any, moe_path: str) -> None:
    prompt = PROMPT[:12]
    ref = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    body = {"prompt": prompt, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0.0,
            "return_routed_experts": True, "routed_experts_start_len": 2}
    for client in app_client(engine):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        whole = {"output_ids": ref["output_ids"],
                 "meta_info": {"routed_experts": r.json()["sglext"]["routed_experts"]}}
        assert_hf_routing(moe_path, prompt, whole, start=2)
        stream = client.post("/v1/completions", json={**body, "stream": True})
        events = [json.loads(line[len("data: "):]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert [e["choices"][0]["finish_reason"] is not None for e in events if "sglext" in e] \
            == [True]
        last = next(e for e in events if "sglext" in e)
        assert_hf_routing(moe_path, prompt, {**whole, "meta_info": last["sglext"]}, start=2)
        plain = client.post("/v1/completions", json={**body, "return_routed_experts": False})
        assert "sglext" not in plain.json()


# -- refusals -----------------------------------------------------------------------------------
def test_refused_without_the_flag_while_other_requests_run(qwen2_engine: Any) -> None:
    running = qwen2_engine.generate(input_ids=PROMPT[:8], stream=True, sampling_params={
        "max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True})
    first = next(running)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        qwen2_engine.generate(input_ids=PROMPT[:8], sampling_params=GREEDY,
                              return_routed_experts=True)
    chunks = [first, *running]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    for client in app_client(qwen2_engine):
        r = client.post("/generate", json={"input_ids": PROMPT[:8], "sampling_params": GREEDY,
                                           "return_routed_experts": True})
        assert r.status_code == 400
        assert "--enable-return-routed-experts" in r.json()["error"]["message"]


def test_refused_on_a_model_without_experts(make_engine: Any, qwen2_path: str) -> None:
    eng = make_engine(qwen2_path, enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="return_routed_experts: the model has no experts"):
        eng.generate(input_ids=PROMPT[:8], sampling_params=GREEDY, return_routed_experts=True)
    assert len(eng.generate(input_ids=PROMPT[:8], sampling_params=GREEDY)["output_ids"]) == 8


def test_the_hierarchical_cache_is_refused_with_the_flag(moe_path: str) -> None:
    with pytest.raises(ValueError, match="enable_hierarchical_cache: is not supported with "
                                         "enable_return_routed_experts"):
        EngineConfig(model_path=moe_path, enable_return_routed_experts=True,
                     enable_hierarchical_cache=True)
