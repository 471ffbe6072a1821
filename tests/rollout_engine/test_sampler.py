"""The sampler against a reference distribution: chi-square goodness of fit with fixed seeds.

Every draw is a row of one big batch: identical logits, a different counter-based uniform each,
so N rows are N independent samples of the row's filtered distribution. The expected
distribution is computed here from the definitions (not with the sampler's code), and the
statistic is compared with the chi-square critical value at p = 0.001 (hard-coded, no scipy).
The one-pass sampler against a float64 reference: ``test_sampler_reference.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import pytest
import torch

from rollout_engine.sampler import Penalties, SamplingBatch, compute_logprobs, sample
from rollout_engine.sampling_seeds import uniform_for, uniforms_for

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
