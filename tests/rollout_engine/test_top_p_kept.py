"""Each output token's kept nucleus (``custom_params.return_top_p_token_ids``, what slime asks
for when ``top_p < 1`` and its trainer needs to renormalise): the sampler reports exactly the
set a full stable sort keeps under top-k / top-p / min-p, the sampled token is always in it,
and the engine returns it as ``top_p_token_ids`` / ``top_p_token_offsets`` (CSR over the output
tokens), streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rollout_engine.sampler import SamplingBatch, sample
from rollout_engine.sampling_seeds import uniforms_for
from tests.rollout_engine.engines import app_client, thread_engine

VOCAB = 300


def _reference_kept(lp: torch.Tensor, top_k: int, top_p: float, min_p: float) -> list[int]:
    """The nucleus by definition: a stable descending sort (ties to the lower id), the first
    ``top_k``, each token while the mass before it is < ``top_p``, then min-p."""
    vals, ids = lp.to(torch.float64).sort(descending=True, stable=True)
    probs = vals.exp()
    before = probs.cumsum(0) - probs
    keep = (torch.arange(len(ids)) < top_k) & (before < top_p)
    keep[0] = True
    keep &= probs >= probs[0] * min_p
    return sorted(ids[keep].tolist())


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_set_is_the_nucleus_and_holds_the_sampled_token(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b = 8
    logits = torch.randn(b, VOCAB, generator=g) * 2.5
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0, 0.5, 1.1])
    top_ps = torch.tensor([0.9, 0.8, 1.0, 0.95, 0.5, 0.99, 1.0, 0.7])
    top_ks = torch.tensor([VOCAB, 40, 12, VOCAB, VOCAB, 3, VOCAB, 200])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0])
    sb = SamplingBatch(temperatures=temps, top_ps=top_ps, top_ks=top_ks, min_ps=min_ps,
                       uniforms=uniforms_for(list(range(b)), [seed] * b),
                       kept_rows=list(range(1, b)) + [0])
    out = sample(logits.clone(), sb)
    assert sorted(out.kept) == list(range(b))
    assert out.kept[0] == [out.token_ids[0]]                  # greedy keeps its one token
    for r in range(1, b):
        lp = torch.log_softmax(logits[r] / temps[r], dim=-1)
        assert out.kept[r] == _reference_kept(lp, int(top_ks[r]), float(top_ps[r]),
                                              float(min_ps[r])), r
        assert out.token_ids[r] in out.kept[r]
    plain = sample(logits.clone(), SamplingBatch(temperatures=temps, top_ps=top_ps,
                                                 top_ks=top_ks, min_ps=min_ps,
                                                 uniforms=sb.uniforms))
    assert plain.token_ids == out.token_ids and plain.kept == {}   # asking changes no token


@pytest.fixture(scope="module")
def engine(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=256)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:
    yield from app_client(engine)


def _rows(meta: dict[str, Any]) -> list[list[int]]:
    ids, offsets = meta["top_p_token_ids"], meta["top_p_token_offsets"]
    assert offsets[0] == 0 and offsets[-1] == len(ids)
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


SAMPLED = {"temperature": 1.0, "top_p": 0.8, "max_new_tokens": 12, "sampling_seed": 5,
           "ignore_eos": True, "custom_params": {"return_top_p_token_ids": True}}


def test_slime_request_gets_one_nucleus_per_output_token(client: Any) -> None:
    body = {"input_ids": [5, 40, 100, 7], "sampling_params": SAMPLED, "return_logprob": True}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    rows = _rows(out["meta_info"])
    assert len(rows) == len(out["output_ids"]) == 12
    assert all(t in row for t, row in zip(out["output_ids"], rows))
    assert any(len(row) > 1 for row in rows)
    plain = client.post("/generate", json={**body, "sampling_params": {
        **SAMPLED, "custom_params": None}}).json()
    assert plain["output_ids"] == out["output_ids"] and "top_p_token_ids" not in plain["meta_info"]
    bad = client.post("/generate", json={**body, "sampling_params": {
        **SAMPLED, "custom_params": {"return_top_p_token_ids": "yes"}}})
    assert bad.status_code == 400 and "return_top_p_token_ids" in bad.text


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_chunks_carry_the_nuclei(engine: Any, incremental: bool) -> None:
    whole = engine.generate(input_ids=[5, 40, 100, 7], sampling_params=SAMPLED)
    want = _rows(whole["meta_info"])
    chunks = list(engine.generate(input_ids=[5, 40, 100, 7], sampling_params=SAMPLED,
                                  stream=True))
    if incremental:   # a delta stream's chunks concatenate to the whole
        from rollout_engine.request_state import ChunkStream
        st = engine.tm.submit(engine.tm.build_requests(
            None, [5, 40, 100, 7], SAMPLED, False, 0, -1, True, None, None)[0])[0]
        chunks = list(ChunkStream(st, lambda rid: None, cumulative=False))
        got = [row for c in chunks for row in _rows(c["meta_info"])]
    else:            # a cumulative stream's last chunk holds them all
        got = _rows(chunks[-1]["meta_info"])
    assert got == want
