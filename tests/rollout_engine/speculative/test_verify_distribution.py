"""The acceptance rule on controlled logits: outputs follow the target's filtered distribution.

Three verify rows (the last token + two proposals) with fixed logits; each trial is one request
seed, so N trials are N independent runs of ``sample`` + ``accept_walk`` on the same rows, all in
one batch. The expected distributions are computed here from the definitions (softmax at T, a
stable top-k, the smallest top-p head, min-p, renormalised), not with the sampler's code, and
the chi-square statistic is compared with the critical value at p = 0.001.

For a deterministic proposal ``d`` (n-gram drafts) rejection sampling must accept ``d`` with
probability ``p(d)`` and otherwise emit a token of ``p`` with ``d`` removed and renormalised;
the second row must be reached only after an acceptance and then follow ``p_1``. A control
case checks that the test rejects a wrong target (the unfiltered softmax), so it can fail.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from rollout_engine.sampler import SamplingBatch, sample
from rollout_engine.sampling_seeds import uniform_for
from rollout_engine.speculative.verify import accept_walk

N = 6000
LOGITS = torch.tensor([
    [2.0, 1.6, 1.0, 0.5, 0.0, -0.5, 2.4, 0.2],
    [0.3, 2.2, -1.0, 1.9, 0.7, 0.0, 1.1, -0.4],
    [1.0, 0.0, 0.5, 1.5, -0.5, 2.0, 0.1, 0.9],
])
VOCAB = LOGITS.shape[1]
DRAFT = [0, 3]     # second / third most likely at rows 0 and 1: accepted and rejected often
CHI2_CRIT = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124]   # p = 0.001

CASES = {   # (temperature, top_k, top_p, min_p)
    "temperature": (0.8, VOCAB, 1.0, 0.0),
    "top_k": (1.0, 4, 1.0, 0.0),
    "top_p": (1.2, VOCAB, 0.85, 0.0),
    "min_p": (1.0, VOCAB, 1.0, 0.2),
    "all": (0.9, 6, 0.9, 0.05),
}


def filtered(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> list[float]:
    """The target's distribution of one row, from the definitions, in float64."""
    probs = torch.softmax(logits.double() / t, dim=-1)
    order = sorted(range(VOCAB), key=lambda i: (-float(probs[i]), i))
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank < k and mass < p:
            keep.add(i)
        mass += float(probs[i])
    top = float(probs.max())
    keep = {i for i in keep if float(probs[i]) >= top * m}
    total = sum(float(probs[i]) for i in keep)
    return [float(probs[i]) / total if i in keep else 0.0 for i in range(VOCAB)]


def run_trials(t: float, k: int, p: float, m: float) -> list[list[int]]:
    """Emitted tokens of N independent verify steps (seeds 0..N-1)."""
    rows = LOGITS.repeat(N, 1)
    n = rows.shape[0]
    sb = SamplingBatch(
        temperatures=torch.full((n,), t), top_ps=torch.full((n,), p),
        top_ks=torch.full((n,), k, dtype=torch.int64), min_ps=torch.full((n,), m),
        uniforms=torch.tensor([uniform_for(seed, j) for seed in range(N) for j in range(3)],
                              dtype=torch.float64))
    out = sample(rows, sb)
    return [accept_walk(out, 3 * s, DRAFT).tokens for s in range(N)]


def chi2(counts: collections.Counter, expected: list[float], total: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for tok, q in enumerate(expected):
        if q > 0:
            stat += (counts[tok] - total * q) ** 2 / (total * q)
            cells += 1
        else:
            assert counts[tok] == 0, f"token {tok} has probability 0 but was emitted"
    return stat, cells - 1


def assert_fits(counts: collections.Counter, expected: list[float], total: int) -> None:
    stat, dof = chi2(counts, expected, total)
    assert dof >= 1 and stat < CHI2_CRIT[dof - 1], (stat, dof, counts, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_filtered_target(case: str) -> None:
    t, k, p, m = CASES[case]
    p0, p1 = filtered(LOGITS[0], t, k, p, m), filtered(LOGITS[1], t, k, p, m)
    runs = run_trials(t, k, p, m)
    first = collections.Counter(r[0] for r in runs)
    assert_fits(first, p0, N)                     # the first token is p_0's, whatever the draft
    accepted = [r for r in runs if r[0] == DRAFT[0]]
    # accepted with probability p_0(d): within 4 standard deviations
    sd = math.sqrt(N * p0[DRAFT[0]] * (1 - p0[DRAFT[0]]))
    assert abs(len(accepted) - N * p0[DRAFT[0]]) < 4 * sd + 1
    rejected = collections.Counter(r[0] for r in runs if r[0] != DRAFT[0])
    rest = [0.0 if i == DRAFT[0] else q / (1 - p0[DRAFT[0]]) for i, q in enumerate(p0)]
    assert_fits(rejected, rest, N - len(accepted))   # p with d removed, renormalised
    assert all(len(r) == 1 for r in runs if r[0] != DRAFT[0])   # a rejection ends the step
    if len(accepted) > 200:
        assert_fits(collections.Counter(r[1] for r in accepted), p1, len(accepted))
    # the third row is reached only through two acceptances
    assert all(len(r) == 3 for r in runs if r[:2] == DRAFT)
    assert all(len(r) == 2 for r in accepted if r[1] != DRAFT[1])


def test_the_check_rejects_a_wrong_target() -> None:
    """Control: the unfiltered softmax is not what top-k = 4 draws, and chi-square says so."""
    t, k, p, m = CASES["top_k"]
    runs = run_trials(t, k, p, m)
    first = collections.Counter(r[0] for r in runs)
    wrong = torch.softmax(LOGITS[0].double(), dim=-1).tolist()
    stat, dof = chi2(first, wrong, N)
    assert stat > CHI2_CRIT[dof - 1]


def test_greedy_accepts_exactly_while_the_argmax_agrees() -> None:
    n = 3
    sb = SamplingBatch(temperatures=torch.zeros(n), top_ps=torch.ones(n),
                       top_ks=torch.full((n,), VOCAB, dtype=torch.int64), min_ps=torch.zeros(n),
                       uniforms=torch.full((n,), 0.5, dtype=torch.float64))
    out = sample(LOGITS.clone(), sb)
    argmax = LOGITS.argmax(-1).tolist()          # [6, 1, 5]
    assert accept_walk(out, 0, [6, 1]).tokens == [6, 1, 5]
    assert accept_walk(out, 0, [6, 2]).tokens == [6, 1]
    assert accept_walk(out, 0, [0, 1]).tokens == [argmax[0]]
    assert accept_walk(out, 0, [6, 1]).num_accepted == 2
