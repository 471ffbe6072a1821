"""``logprobs_mode="processed_logprobs"``: the returned logprobs are vLLM's processed ones
(after bans, penalties, temperature, min-p, top-k and top-p; masked tokens -inf).

The reference (``processed_logprobs_ref``) is vLLM's definition written one row at a time; the
batched pass is checked against it on random logits, and a whole engine's returned logprobs
against it on the logits transformers computes for the same tokens."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rollout_engine.penalties import Penalties
from rollout_engine.processed_logprobs import processed_logprobs, processed_logprobs_ref
from rollout_engine.sampler import SamplingBatch
from tests.rollout_engine.engines import thread_engine

# (temperature, top_k, top_p, min_p, repetition, frequency, presence)
ROWS = [
    (0.7, 5, 1.0, 0.0, 1.0, 0.0, 0.0),
    (1.0, -1, 0.8, 0.0, 1.0, 0.0, 0.0),
    (1.3, -1, 1.0, 0.1, 1.0, 0.0, 0.0),
    (0.9, -1, 1.0, 0.0, 1.3, 0.0, 0.0),
    (0.0, -1, 1.0, 0.0, 1.2, 0.0, 0.0),
    (0.8, 10, 0.9, 0.05, 1.1, 0.3, 0.5),
    (1.0, 2, 1.0, 0.0, 1.0, 0.0, 0.0),
]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite], atol=tol, rtol=0)


def test_batched_pass_matches_the_reference() -> None:
    torch.manual_seed(0)
    b, vocab = len(ROWS), 97
    logits = torch.randn(b, vocab) * 3
    temps, ks, ps, mins = (torch.tensor([r[i] for r in ROWS]) for i in range(4))
    ks = torch.where(ks < 0, torch.tensor(float(vocab)), ks).to(torch.int64)
    rows, ids, rep, bias = [], [], [], []
    touched: list[dict[int, float]] = [{} for _ in ROWS]
    for row, (_, _, _, _, r, f, p) in enumerate(ROWS):
        for tok, count in ((3, 2), (17, 1), (40, 0)):
            if r == 1.0 and f == 0 and p == 0:
                continue
            x = float(logits[row, tok])
            x = x / r if x > 0 else x * r
            x -= f * count + p * (count > 0)
            rows.append(row)
            ids.append(tok)
            rep.append(r)
            bias.append(-(f * count + p * (count > 0)))
            touched[row][tok] = x
    pen = Penalties(rows=torch.tensor(rows), ids=torch.tensor(ids),
                    repetition=torch.tensor(rep), bias=torch.tensor(bias),
                    banned=(torch.tensor([1]), torch.tensor([5])))
    touched[1][5] = float("-inf")
    sb = SamplingBatch(temperatures=temps.float(), top_ps=ps.float(), top_ks=ks,
                       min_ps=mins.float(), uniforms=torch.zeros(b, dtype=torch.float64),
                       penalties=pen)
    got = processed_logprobs(logits, sb)
    for row, (t, k, p, m, *_) in enumerate(ROWS):
        want = processed_logprobs_ref(logits[row], t, max(k, 0), p, m, touched[row])
        _close(got[row], want, 1e-6)
    assert bool(torch.isinf(got[0]).sum() == vocab - 5)      # top-k 5 keeps five
    assert bool(torch.isinf(got[6]).sum() == vocab - 2)


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def hf_model(qwen2_path: str) -> Any:
    from tests.rollout_engine.hf_reference import hf_model

    return hf_model(qwen2_path)   # shared with the other parity tests (cached)


def _expected(hf_model: Any, prompt: list[int], out: list[int], k: int,
              row: tuple[float, ...]) -> torch.Tensor:
    """vLLM's processed logprobs at output step ``k``, from transformers' logits."""
    t, top_k, top_p, min_p, r, f, p = row
    with torch.no_grad():
        x = hf_model(torch.tensor([prompt + out[:k]])).logits[0, -1].float()
    counts = Counter(out[:k])
    penalised: dict[int, float] = {}
    for tok in set(prompt) | set(out[:k]):
        v = float(x[tok])
        if r != 1.0:
            v = v / r if v > 0 else v * r
        v -= f * counts[tok] + p * (counts[tok] > 0)
        penalised[tok] = v
    return processed_logprobs_ref(x, t, max(top_k, 0), top_p, min_p, penalised)


def test_engine_returns_processed_logprobs(engine: Any, hf_model: Any) -> None:
    prompts = [[11 + i, 12, 13 + 2 * i, 14, 11 + i] for i in range(len(ROWS))]
    params = [{"max_new_tokens": 4, "temperature": t, "top_k": k, "top_p": p, "min_p": m,
               "repetition_penalty": r, "frequency_penalty": f, "presence_penalty": pr,
               "ignore_eos": True, "sampling_seed": 5 + i}
              for i, (t, k, p, m, r, f, pr) in enumerate(ROWS)]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                           top_logprobs_num=3)
    for prompt, row, res in zip(prompts, ROWS, outs):
        ids = res["output_ids"]
        meta = res["meta_info"]
        for k, tok in enumerate(ids):
            want = _expected(hf_model, prompt, ids, k, row)
            lp, got_id, _ = meta["output_token_logprobs"][k]
            assert got_id == tok and lp == pytest.approx(float(want[tok]), abs=1e-4)
            top_want = torch.topk(want, 3).values.tolist()
            top_got = [e[0] for e in meta["output_top_logprobs"][k]]
            for g, w in zip(top_got, top_want):
                assert g == w or g == pytest.approx(w, abs=1e-4)
    # top_k = 2: the third candidate is masked
    assert all(top[2][0] == float("-inf") for top in outs[-1]["meta_info"]["output_top_logprobs"])


# -- against vLLM itself ---------------------------------------------------------------------
PEER_ROWS = [   # vLLM's SamplingParams fields; one token each, the top candidates compared
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.3, "min_p": 0.1},
    {"temperature": 0.9, "repetition_penalty": 1.3},
    {"temperature": 0.0, "repetition_penalty": 1.2},
    {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.02,
     "repetition_penalty": 1.15},
]
PEER_TOP = 8


@pytest.mark.slow
def test_processed_logprobs_match_vllm(tmp_path: Any) -> None:
    """vLLM's CPU build and this engine, both in processed_logprobs mode, on one tiny model
    (head_dim 64: vLLM's CPU attention needs it): the top candidates of the first output
    position agree within 1e-4, masked ones (-inf) included."""
    import json
    import subprocess
    from pathlib import Path

    from benchmarks.vllm_peer import vllm_env
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path
    from tests.rollout_engine.vllm.vllm_venv import vllm_python

    model = str(tiny_model_path("qwen2", hidden_size=128, num_heads=2, num_kv_heads=2))
    prompts = [[11 + i, 12, 13 + 2 * i, 14, 11 + i] for i in range(len(PEER_ROWS))]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": model, "num": PEER_TOP, "requests": [
        {"prompt": p, "params": r} for p, r in zip(prompts, PEER_ROWS)]}))
    peer = Path(__file__).with_name("vllm_processed_peer.py")
    run = subprocess.run([vllm_python(), str(peer), str(spec)], capture_output=True,
                         text=True, env=vllm_env(), timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])

    engine = Engine(model_path=model, scheduler_mode="thread", dtype="float32", device="cpu",
                    logprobs_mode="processed_logprobs")
    try:
        params = [{"max_new_tokens": 1, "sampling_seed": 1, **r} for r in PEER_ROWS]
        ours = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               top_logprobs_num=PEER_TOP)
    finally:
        engine.shutdown()
    for row, their_top, res in zip(PEER_ROWS, theirs, ours):
        mine = res["meta_info"]["output_top_logprobs"][0]
        their_finite = {t: lp for t, lp in their_top[:PEER_TOP] if lp != float("-inf")}
        my_finite = {t: lp for lp, t, _ in mine if lp != float("-inf")}
        assert set(my_finite) == set(their_finite), row
        for t, lp in their_finite.items():
            assert my_finite[t] == pytest.approx(lp, abs=1e-4), (row, t)


def test_processed_logprobs_refused_with_speculative_decoding(qwen2_path: str) -> None:
    """A drafting scheduler reports its verified tokens' raw logprobs: refused by name."""
    from rollout_engine.config import EngineConfig

    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(model_path=qwen2_path, logprobs_mode="processed_logprobs",
                     speculative_algorithm="NGRAM")


def test_sampled_tokens_come_from_the_processed_distribution(engine: Any) -> None:
    """min-p, top-k and top-p together keep fewer tokens in vLLM's order than the default
    sampler's: a sampled token is always one the processed distribution keeps (a finite
    logprob), whatever the seed."""
    prompt = [11, 12, 13, 14, 11]
    params = [{"max_new_tokens": 3, "temperature": 1.0, "top_p": p, "top_k": k, "min_p": m,
               "ignore_eos": True, "sampling_seed": seed}
              for seed in range(24)
              for p, k, m in ((0.9, -1, 0.01), (0.7, 20, 0.0), (0.8, 30, 0.05))]
    outs = engine.generate(input_ids=[prompt] * len(params), sampling_params=params,
                           return_logprob=True)
    lps = [lp for res in outs for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
    assert len(lps) == 3 * len(params)
    assert all(math.isfinite(lp) for lp in lps)
    again = engine.generate(input_ids=[prompt] * 3, sampling_params=params[:3],
                            return_logprob=True)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in outs[:3]]


def test_openai_routes_floor_masked_logprobs_as_vllm_does(engine: Any) -> None:
    """A masked candidate is -inf: the OpenAI routes show vLLM's -9999.0 (JSON has no
    infinity; null broke TRL's client, which sorts the values)."""
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/completions", json={
            "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 1.0, "top_k": 2,
            "logprobs": 3, "seed": 3})
        assert r.status_code == 200, r.text
        tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert all(sorted(t.values())[0] == -9999.0 for t in tops)
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 1.0, "top_k": 2, "logprobs": True, "top_logprobs": 3, "seed": 3})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert all(e["top_logprobs"][2]["logprob"] == -9999.0 for e in content)
