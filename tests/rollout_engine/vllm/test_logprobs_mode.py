"""``logprobs_mode="processed_logprobs"``: the returned logprobs are vLLM's processed ones
(after bans, penalties, temperature, min-p, top-k and top-p; masked tokens -inf).

The reference (``processed_logprobs_ref``) is vLLM's definition written one row at a time; the
batched pass is checked against it on random logits, and a whole engine's returned logprobs
against it on the logits transformers computes for the same tokens."""

from __future__ import annotations

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
