"""The one-pass sampler against ``reference_sample`` (float64, full softmax, full stable sort,
explicit filters, inverse CDF with the same uniforms): token for token on every option
combination, with and without penalties, and in frequency on a large vocabulary."""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from rollout_engine.sampler import PenaltyCounts, SamplingBatch, sample
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.sampling_seeds import uniform_for
from rollout_engine.scheduler.batch import SamplingRowsCache, build_sampling_batch


@functools.lru_cache(maxsize=4)
def uniforms(seed: int, n: int) -> torch.Tensor:
    return torch.tensor([uniform_for(seed, k) for k in range(n)], dtype=torch.float64)


def reference_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float, u: float, penalise=None) -> tuple[int, float]:
    """One row, the definitions in float64: logprob = log_softmax(logits / T) of the raw row;
    the sample from softmax(penalised / T), a full stable descending sort, top-k, top-p (a token
    stays while the mass before it < p), min-p on the top probability, then inverse CDF with
    ``u`` over the kept tokens in vocabulary order. Greedy (T = 0 or top_k = 1): the argmax."""
    x = logits.to(torch.float64)
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(x / t, dim=-1)
    z = penalise(x) if penalise is not None else x
    if temperature == 0 or top_k == 1:
        token = int(z.argmax())
        return token, float(logprobs[token])
    probs = torch.softmax(z / t, dim=-1)
    vocab = probs.numel()
    order = torch.sort(probs, descending=True, stable=True).indices
    before = probs[order].cumsum(0) - probs[order]
    keep_sorted = (torch.arange(vocab) < (vocab if top_k == -1 else top_k)) & (before < top_p)
    keep_sorted[0] = True
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order] = keep_sorted
    keep &= probs >= probs.max() * min_p
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = kept.cumsum(0)
    j = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64),
                               right=True))
    last_kept = int(keep.nonzero().max())
    token = min(j, last_kept)
    return token, float(logprobs[token])


GRID = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.0, 0.7, 1.0, 1.3) for k in (-1, 1, 5, 50) for p in (1.0, 0.9, 0.5)
        for m in (0.0, 0.1)]
REF_VOCAB, REF_ROWS = 600, 24


class _Req:
    """The fields of a scheduler Req that the sampling-batch builder reads."""

    def __init__(self, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self.input_ids, self.output_ids, self.params, self.seed = prompt, [], params, seed
        self.penalty_row = None
        self.top_p_kept = None
        self.return_logprob, self.top_logprobs_num = True, 0


def _penaliser(req: _Req, eos: frozenset[int]):
    """The reference penalties of ``req`` now, from its whole token lists (no counts kept)."""
    p = req.params
    seen = set(req.input_ids) | set(req.output_ids)
    counts = collections.Counter(req.output_ids)
    banned = ((set(p.stop_token_ids) | (set() if p.ignore_eos else eos))
              if len(req.output_ids) < p.min_new_tokens else set())

    def penalise(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        if p.repetition_penalty != 1.0:
            for i in seen:
                x[i] = x[i] / p.repetition_penalty if x[i] > 0 else x[i] * p.repetition_penalty
        for i, c in counts.items():
            x[i] -= p.frequency_penalty * c + p.presence_penalty
        for i in banned:
            x[i] = float("-inf")
        return x
    return penalise


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("penalties", [None, "most", "few"])
def test_tokens_and_logprobs_equal_the_reference_on_every_option(penalties, cached):
    """Every combination of T, top_k, top_p and min_p, with and without penalties (frequency,
    presence, repetition, min_new_tokens banning EOS), over several decode steps of fixed seeds:
    the same tokens as the float64 reference with the same uniforms, logprobs within 4e-6
    (relative past 1).
    Penalty counts are kept incrementally by ``PenaltyCounts``; the reference recounts.
    ``cached``: the rows' parameters and what ``sample`` derives from them are kept across the
    steps (``SamplingRowsCache``), as the scheduler's decode steps do; from the third step on
    the batch loses a row and is reordered, so the kept rows must be rebuilt."""
    g = torch.Generator().manual_seed(3)
    eos = frozenset({3})
    pool = PenaltyCounts(REF_VOCAB, torch.device("cpu"))
    steps = 4 if cached else 3 if penalties else 1
    cache = SamplingRowsCache() if cached else None
    reqs, rows = [], []
    for c, case in enumerate(GRID):
        extra = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3,
                     min_new_tokens=2) if penalties else {}
        for r in range(REF_ROWS if not penalties else REF_ROWS // 4):
            # mixed batches: 2 rows in 3 with penalties, or 1 in 3
            has = (r % 3 != 0) if penalties == "most" else (r % 3 == 0)
            params = SamplingParams(**case, **(extra if has else {}))
            prompt = torch.randint(0, REF_VOCAB, (20,), generator=g).tolist()
            reqs.append(_Req(prompt, params, seed=1000 * c + r))
    total, everyone = 0, reqs
    kept = None
    for step in range(steps):
        if cached and step == 2:
            reqs = reqs[:0:-1]     # one row fewer, the rest reversed
        logits = torch.randn(len(reqs), REF_VOCAB, generator=g) * 3
        logits[:, 3] = logits.max() + 1   # EOS the favourite: min_new_tokens must ban it
        sb = build_sampling_batch(reqs, REF_VOCAB, eos, torch.device("cpu"), pool, cache=cache)
        if cached and step == 1:   # the same rows: their parameters were kept
            assert sb.temperatures is kept.temperatures and sb.derived is kept.derived
            assert (sb.penalties is None) == (penalties is None)
        kept = sb
        before = logits.clone()
        out = sample(logits, sb)
        assert torch.equal(logits, before)   # penalty entries are restored
        for i, req in enumerate(reqs):
            p = req.params
            want = reference_sample(logits[i], p.temperature, p.top_k, p.top_p, p.min_p,
                                    uniform_for(req.seed, len(req.output_ids)),
                                    _penaliser(req, eos))
            assert out.token_ids[i] == want[0], (p, i)
            # float32 log_softmax: a few ulps of the log-sum-exp (its ulp at 13 is 1e-6; the
            # kernel's AVX-512 and AVX2 builds sum in different orders), relative past 1
            tol = 4e-6 * max(1.0, abs(want[1]))
            assert abs(out.logprobs[i] - want[1]) < tol, (p, out.logprobs[i], want[1])
            total += 1
        rows = [(r.penalty_row, t) for r, t in zip(reqs, out.token_ids) if r.penalty_row is not None]
        if rows:
            pool.record([row for row, _ in rows], [t for _, t in rows])
        for req, t in zip(reqs, out.token_ids):
            req.output_ids.append(t)
    assert total == (steps * len(reqs) + (2 if cached else 0))
    if cached:
        assert sb.derived is not None and (bool(sb.derived) == (penalties is None))
    assert (pool.num_used > 0) == bool(penalties)
    for req in everyone:
        if req.penalty_row is not None:
            pool.give_back(req.penalty_row)
    assert pool.num_used == 0 and pool.counts.shape[0] == 0   # memory goes when the rows do


def test_ties_across_the_cut_keep_the_lowest_ids():
    """Rounded logits tie a lot (as bf16 ones do): the kept part of a group tied across the
    top-k / top-p cut is its lowest ids, as a stable sort keeps, on the topk path too."""
    g = torch.Generator().manual_seed(4)
    vocab = 4096
    logits = (torch.randn(64, vocab, generator=g) * 2).round()
    for case in (dict(top_k=50), dict(top_k=7, top_p=0.9), dict(top_p=0.3),
                 dict(top_p=0.5, temperature=0.5)):
        full = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, **case}
        sb = SamplingBatch(
            temperatures=torch.full((64,), full["temperature"]),
            top_ps=torch.full((64,), full["top_p"]),
            top_ks=torch.full((64,), vocab if full["top_k"] == -1 else full["top_k"]),
            min_ps=torch.zeros(64), uniforms=uniforms(9, 64).clone())
        out = sample(logits, sb)
        for i in range(64):
            want, _ = reference_sample(logits[i], full["temperature"], full["top_k"],
                                       full["top_p"], 0.0, float(sb.uniforms[i]))
            assert out.token_ids[i] == want, (case, i)


@pytest.mark.parametrize("case", [dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.8),
                                  dict(top_p=0.95, min_p=0.05), dict(top_p=0.6, temperature=1.7)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_frequencies_match_the_reference_on_a_large_vocabulary(case):
    """Empirical frequencies of 10,000 draws on a 3000-token vocabulary (the topk path, not the
    small-vocabulary sort) against the reference's probabilities: every token within 5 sigma,
    and nothing outside the kept set."""
    g = torch.Generator().manual_seed(5)
    vocab, n = 3000, 10_000
    row = torch.randn(vocab, generator=g) * 3
    full = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, **case}
    sb = SamplingBatch(
        temperatures=torch.full((n,), full["temperature"]), top_ps=torch.full((n,), full["top_p"]),
        top_ks=torch.full((n,), vocab if full["top_k"] == -1 else full["top_k"]),
        min_ps=torch.full((n,), full["min_p"]), uniforms=uniforms(11, n).clone())
    out = sample(row.expand(n, -1).contiguous(), sb)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double() / n
    # the reference's probabilities: its kept set, renormalised
    t = full["temperature"]
    probs = torch.softmax(row.double() / t, -1)
    order = torch.sort(probs, descending=True, stable=True).indices
    before = probs[order].cumsum(0) - probs[order]
    k = vocab if full["top_k"] == -1 else full["top_k"]
    keep_sorted = (torch.arange(vocab) < k) & (before < full["top_p"])
    keep_sorted[0] = True
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order] = keep_sorted
    keep &= probs >= probs.max() * full["min_p"]
    want = torch.where(keep, probs, 0.0)
    want /= want.sum()
    assert not (freq[~keep] > 0).any(), "a filtered-out token was sampled"
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq - want).abs().max()
    assert int(keep.sum()) > 1


