"""The sampler against a reference distribution: chi-square goodness of fit with fixed seeds.

Every draw is a row of one big batch: identical logits, a different counter-based uniform each,
so N rows are N independent samples of the row's filtered distribution. The expected
distribution is computed here from the definitions (not with the sampler's code), and the
statistic is compared with the chi-square critical value at p = 0.001 (hard-coded, no scipy).

Below, the one-pass sampler against ``reference_sample`` (float64, full softmax, full stable
sort, explicit filters, inverse CDF with the same uniforms): token for token on every option
combination, with and without penalties, and in frequency on a large vocabulary.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Optional

import pytest
import torch

from rollout_engine.sampler import Penalties, PenaltyCounts, SamplingBatch, compute_logprobs, sample
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.sampling_seeds import uniform_for, uniforms_for
from rollout_engine.scheduler.batch import SamplingRowsCache, build_sampling_batch

N = 20_000
LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 0.2, -2.0, 1.2, 0.8]
VOCAB = len(LOGITS)
# chi-square critical values at p = 0.001 for 1..11 degrees of freedom
CHI2_CRIT = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
             31.264]


@functools.lru_cache(maxsize=4)
def uniforms(seed: int, n: int) -> torch.Tensor:
    return torch.tensor([uniform_for(seed, k) for k in range(n)], dtype=torch.float64)


def make_batch(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
               min_p: float = 0.0, seed: int = 0, **extra) -> SamplingBatch:
    def full(v, dtype):
        return torch.full((n,), v, dtype=dtype)

    return SamplingBatch(
        temperatures=full(temperature, torch.float32), top_ps=full(top_p, torch.float32),
        top_ks=full(VOCAB if top_k == -1 else top_k, torch.int64),
        min_ps=full(min_p, torch.float32),
        uniforms=uniforms(seed, n).clone(),
        **extra)


def expected_probs(logits: list[float], temperature: float, top_p: float, top_k: int,
                   min_p: float) -> list[float]:
    """softmax(logits / T), then top-k, top-p (keep a token while the mass before it < p) and
    min-p (relative to the top probability), all on the unfiltered probabilities; renormalised."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set()
    before = 0.0
    for rank, i in enumerate(order):
        if (top_k == -1 or rank < top_k) and (rank == 0 or before < top_p):
            keep.add(i)
        before += p[i]
    keep = {i for i in keep if p[i] >= min_p * p[order[0]]}
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(p))]


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    # (torch.testing.assert_close costs seconds of imports on first use)
    assert got.shape == want.shape and torch.allclose(got, want.to(got.dtype), atol=tol,
                                                      rtol=tol), (got, want)


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic over the kept tokens; bins expecting < 5 draws are pooled."""
    n = sum(counts)
    bins = [(probs[i] * n, counts[i]) for i in range(len(probs)) if probs[i] > 0]
    bins.sort()
    while len(bins) > 1 and bins[0][0] < 5:
        (e0, o0), (e1, o1) = bins[0], bins[1]
        bins = sorted([(e0 + e1, o0 + o1)] + bins[2:])
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return stat, len(bins) - 1


def draw(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, logits=LOGITS, seed=0, **extra):
    rows = torch.tensor([logits], dtype=torch.float32).expand(N, -1).contiguous()
    out = sample(rows, make_batch(N, temperature, top_p, top_k, min_p, seed, **extra))
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits)).tolist(), out


def assert_fits(counts: list[int], probs: list[float]) -> None:
    banned = [i for i, p in enumerate(probs) if p == 0 and counts[i] > 0]
    assert not banned, f"filtered-out tokens {banned} were sampled"
    stat, dof = chi_square(counts, probs)
    if dof == 0:
        return
    assert stat < CHI2_CRIT[dof - 1], f"chi2 {stat:.1f} >= {CHI2_CRIT[dof - 1]} (dof {dof})"


CASES = [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
    dict(top_k=4), dict(top_k=1, temperature=1.0), dict(top_p=0.6), dict(top_p=0.9),
    dict(min_p=0.2), dict(min_p=0.05, temperature=2.0),
    dict(top_k=6, top_p=0.8, temperature=1.5), dict(top_k=5, min_p=0.3, temperature=0.7),
    dict(top_p=0.95, min_p=0.1, temperature=2.0), dict(top_k=8, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_frequencies_match_filtered_softmax(case):
    full = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, **case}
    counts, _ = draw(**full)
    probs = expected_probs(LOGITS, **full)
    assert_fits(counts, probs)


def test_the_statistic_can_fail():
    """Power check: samples at T = 2 are far from the T = 1 distribution."""
    counts, _ = draw(temperature=2.0)
    stat, dof = chi_square(counts, expected_probs(LOGITS, 1.0, 1.0, -1, 0.0))
    assert stat > 10 * CHI2_CRIT[dof - 1]


def test_extreme_uniforms_never_pick_filtered_tokens():
    logits = [5.0, 4.0, -30.0, 3.0, -40.0, 2.0]
    n = 7
    us = [0.0, 1e-17, 0.25, 0.5, 0.999, 1 - 2**-53, 1 - 2**-40]
    for kw in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict()):
        sb = make_batch(n, **kw)
        sb.uniforms = torch.tensor(us, dtype=torch.float64)
        out = sample(torch.tensor([logits] * n), sb)
        probs = expected_probs(logits, 1.0, kw.get("top_p", 1.0), kw.get("top_k", -1),
                               kw.get("min_p", 0.0))
        assert all(probs[t] > 0 for t in out.token_ids), (kw, out.token_ids)
    # u = 0 takes the most likely token, u -> 1 the last kept one in id order
    assert out.token_ids[0] == 0 and out.token_ids[-2] == 5


def test_greedy_rows_return_argmax_and_plain_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    sb = make_batch(6, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    out = sample(logits, sb)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1)[:, None]).squeeze(1)
    assert_close(torch.tensor(out.logprobs), ref)


def test_logprobs_are_full_vocab_before_filtering():
    """Mixed batch: each row's logprob is log_softmax(logits / T) of the raw row, T = 1 for
    greedy, whatever top-k / top-p / min-p removed."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 40, generator=g) * 2
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0])
    sb = make_batch(4, top_k=3, top_p=0.7, min_p=0.1, top_logprobs_num=5)
    sb.temperatures = temps
    out = sample(logits, sb)
    t = torch.where(temps > 0, temps, torch.ones_like(temps))
    ref = torch.log_softmax(logits / t[:, None], -1)
    chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert_close(torch.tensor(out.logprobs), chosen)
    assert_close(compute_logprobs(logits, temps), ref)
    assert out.top_logprobs is not None
    for row, top in enumerate(out.top_logprobs):
        vals, idx = ref[row].topk(5)
        assert [i for _, i in top] == idx.tolist()
        assert_close(torch.tensor([v for v, _ in top]), vals)


def _penalised(logits: list[float], penalty: float, seen: set[int]) -> list[float]:
    return [(x / penalty if x > 0 else x * penalty) if i in seen else x
            for i, x in enumerate(logits)]


def _all_rows(n: int, repetition: Optional[dict[int, float]] = None,
              bias: Optional[dict[int, float]] = None,
              banned: Optional[list[int]] = None) -> Penalties:
    """The same penalty entries (token -> value) on every one of ``n`` rows."""
    entries = sorted(set(repetition or {}) | set(bias or {}))

    def per_entry(values: Optional[dict[int, float]], default: float) -> Optional[torch.Tensor]:
        if values is None:
            return None
        return torch.tensor([values.get(t, default) for t in entries]).repeat(n)

    ban = None if not banned else (torch.arange(n).repeat_interleave(len(banned)),
                                   torch.tensor(banned).repeat(n))
    return Penalties(rows=torch.arange(n).repeat_interleave(len(entries)),
                     ids=torch.tensor(entries, dtype=torch.int64).repeat(n),
                     repetition=per_entry(repetition, 1.0), bias=per_entry(bias, 0.0),
                     banned=ban)


def test_repetition_penalty_changes_distribution_not_logprobs():
    seen = {7, 0, 5}  # the two most likely tokens and a negative one
    extra = dict(penalties=_all_rows(N, repetition={t: 1.8 for t in seen}))
    counts, out = draw(temperature=1.0, **extra)
    assert_fits(counts, expected_probs(_penalised(LOGITS, 1.8, seen), 1.0, 1.0, -1, 0.0))
    assert counts[7] < 0.6 * N * expected_probs(LOGITS, 1.0, 1.0, -1, 0.0)[7]
    ref = torch.log_softmax(torch.tensor(LOGITS), -1)
    assert_close(torch.tensor(out.logprobs), ref[torch.tensor(out.token_ids)])


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.0), (0.4, 0.6)])
def test_frequency_and_presence_penalties_change_distribution_not_logprobs(frequency, presence):
    """The scheduler turns output counts into an additive bias
    (-frequency * count - presence * [count > 0]); the sampler must apply it before temperature
    and filtering, and keep it out of the returned logprobs."""
    counts_so_far = [0] * VOCAB
    counts_so_far[7], counts_so_far[0], counts_so_far[10] = 3, 1, 2
    bias = [-frequency * c - presence * (c > 0) for c in counts_so_far]
    extra = dict(penalties=_all_rows(N, bias={t: b for t, b in enumerate(bias) if b}))
    counts, out = draw(temperature=0.8, top_k=8, **extra)
    shifted = [x + b for x, b in zip(LOGITS, bias)]
    assert_fits(counts, expected_probs(shifted, 0.8, 1.0, 8, 0.0))
    assert counts[7] < 0.8 * N * expected_probs(LOGITS, 0.8, 1.0, 8, 0.0)[7]
    ref = torch.log_softmax(torch.tensor(LOGITS) / 0.8, -1)
    assert_close(torch.tensor(out.logprobs), ref[torch.tensor(out.token_ids)])


def test_penalties_steer_greedy_but_not_its_logprob():
    logits = torch.tensor([LOGITS])
    sb = make_batch(1, temperature=0.0)
    sb.penalties = _all_rows(1, banned=[7])  # e.g. EOS by min_new_tokens
    out = sample(logits, sb)
    assert out.token_ids == [0]  # the runner-up
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())


def test_rows_do_not_depend_on_batch_neighbours():
    """A row samples the same token alone and inside a batch of other rows and parameters."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 64, generator=g) * 2
    sb = make_batch(8, temperature=1.0, top_p=0.9, top_k=20, seed=5)
    sb.temperatures = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 2.0, 0.0, 1.0])
    sb.min_ps = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.2])
    batched = sample(logits, sb).token_ids
    for i in range(8):
        one = SamplingBatch(sb.temperatures[i:i + 1], sb.top_ps[i:i + 1], sb.top_ks[i:i + 1],
                            sb.min_ps[i:i + 1], sb.uniforms[i:i + 1])
        assert sample(logits[i:i + 1], one).token_ids == [batched[i]]


# -- the one-pass sampler against a straightforward float64 reference -------------------------

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


def test_top_logprobs_only_for_the_rows_that_ask():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 100, generator=g)
    sb = make_batch(4, top_logprobs_num=[0, 3, 0, 1])
    out = sample(logits, sb)
    assert out.top_logprobs is not None
    assert out.top_logprobs[0] == [] and out.top_logprobs[2] == []
    ref = torch.log_softmax(logits, -1)
    for row, k in ((1, 3), (3, 1)):
        vals, idx = ref[row].topk(k)
        assert [i for _, i in out.top_logprobs[row]] == idx.tolist()
        assert_close(torch.tensor([v for v, _ in out.top_logprobs[row]]), vals)
    assert sample(logits, make_batch(4)).top_logprobs is None


def test_batched_uniforms_are_bit_identical_to_the_scalar_ones():
    """build_sampling_batch's uint64-array uniforms equal uniform_for's Python ints, bit for bit,
    on every kind of seed (negative, past 64 bits, the extremes)."""
    import random

    rng = random.Random(0)
    seeds = [0, 1, -1, -(1 << 70), (1 << 64) - 1, (1 << 63) - 1, 1 << 64, 3 ** 60]
    seeds += [rng.getrandbits(64) for _ in range(500)] + [rng.randrange(-2 ** 70, 2 ** 70)
                                                          for _ in range(100)]
    steps = [rng.randrange(0, 1 << 20) for _ in seeds]
    got = uniforms_for(seeds, steps)
    assert got.dtype == torch.float64
    assert got.tolist() == [uniform_for(s, k) for s, k in zip(seeds, steps)]
