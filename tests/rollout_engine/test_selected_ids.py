"""Logprobs of chosen token ids, against transformers on the same checkpoint: SGLang's
``token_ids_logprob`` at every output and prompt position, and the per-position
``token_ids_logprob_positions`` an on-policy distillation trainer scores a sequence with
(``max_new_tokens`` 0), over the Python Engine and HTTP; bad shapes are refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.rollout_engine.engines import app_client, thread_engine
from tests.rollout_engine.hf_reference import hf_model

PROMPT = [5, 40, 100, 7, 23, 311, 9]
CHOSEN = [3, 17, 250]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=256, chunked_prefill_size=4)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:
    yield from app_client(engine)


def _hf_lp(path: str, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V]: row p is log P(. | ids[:p]) (row 0 unused)."""
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return torch.cat([torch.full_like(lp[:1], float("nan")), lp[:-1]])


def _close(got: list[list[Any]], want: torch.Tensor, ids: list[int]) -> None:
    assert [t for _, t, _ in got] == ids
    for (lp, t, _) in got:
        assert abs(lp - float(want[t])) < TOL, (t, lp, float(want[t]))


def test_chosen_ids_at_every_output_and_prompt_position(engine: Any, qwen2_path: str) -> None:
    out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0.7,
                                                             "max_new_tokens": 5,
                                                             "sampling_seed": 3},
                          return_logprob=True, logprob_start_len=2, token_ids_logprob=CHOSEN)
    meta = out["meta_info"]
    full = PROMPT + out["output_ids"]
    ref = _hf_lp(qwen2_path, full, temperature=0.7)
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == len(out["output_ids"]) == 5
    for k, entry in enumerate(outs):
        _close(entry, ref[len(PROMPT) + k], CHOSEN)
    ins = meta["input_token_ids_logprobs"]
    assert len(ins) == len(PROMPT) - 2 == len(meta["input_token_logprobs"])
    for j, entry in enumerate(ins):   # the prompt was prefilled in chunks of 4
        _close(entry, ref[2 + j], CHOSEN)


def test_scoring_per_position_ids_over_http(client: Any, qwen2_path: str) -> None:
    """miles' teacher scoring: the prompt is prompt + response, rows of prompt positions
    empty, each response position its own candidates."""
    seq = PROMPT + [42, 8, 77]
    rows: list[list[int]] = [[] for _ in PROMPT] + [[42, 1, 2], [8], [77, 5, 6, 7]]
    body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob_positions": rows}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    got = meta["input_token_ids_logprobs"]
    assert len(got) == len(seq) and got[0] is None
    ref = _hf_lp(qwen2_path, seq)
    for p in range(1, len(seq)):
        _close(got[p], ref[p], rows[p])
    assert r.json()["output_ids"] == [] and "output_token_ids_logprobs" not in meta


@pytest.mark.parametrize("extra, field", [
    ({"token_ids_logprob_positions": [[1]] * 3}, "one row per input token"),
    ({"token_ids_logprob_positions": [[1]] * 7, "sampling_params": {"max_new_tokens": 2}},
     "max_new_tokens = 0"),
    ({"token_ids_logprob_positions": [[10 ** 9]] * 7}, "outside the vocabulary"),
    ({"token_ids_logprob_positions": [[1]] * 7, "logprob_start_len": 3}, "logprob_start_len"),
    ({"token_ids_logprob": [1, "x"]}, "token_ids_logprob"),
    ({"token_ids_logprob": list(range(5000))}, "at most 4096"),
])
def test_bad_shapes_are_refused_by_name(client: Any, extra: dict[str, Any], field: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and field in r.text, r.text
