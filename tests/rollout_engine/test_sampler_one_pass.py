"""The one-pass CPU sampling kernel (``FusedOps.sample_rows``) against the PyTorch sampler
(``sample_reference``), and its place inside ``sample``: which rows it takes, that a row's
token does not depend on which path its neighbours take, and that top logprobs stay
consistent with the returned logprob."""

from __future__ import annotations

import math

import pytest
import torch
from rollout_engine_kernels.cpu.fused_ops import load_fused_ops

from rollout_engine.penalties import Penalties
from rollout_engine.sampler import SamplingBatch, sample, sample_reference
from rollout_engine.sampling_seeds import uniform_for

OPS = load_fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU fused ops did not build here")


def batch(n: int, vocab: int, temperature, min_p=0.0, top_k=None, top_p=1.0, seed=0,
          **extra) -> SamplingBatch:
    def per_row(v, dtype):
        return (torch.tensor(v, dtype=dtype) if isinstance(v, list)
                else torch.full((n,), v, dtype=dtype))

    return SamplingBatch(
        temperatures=per_row(temperature, torch.float32),
        top_ps=per_row(top_p, torch.float32),
        top_ks=per_row(vocab if top_k is None else top_k, torch.int64),
        min_ps=per_row(min_p, torch.float32),
        uniforms=torch.tensor([uniform_for(seed + i, 3) for i in range(n)], dtype=torch.float64),
        **extra)


@pytest.mark.parametrize("vocab", [1, 7, 16, 255, 256, 257, 4099, 32000])
@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.0), (0.6, 0.0), (1.7, 0.1), (0.0, 0.0)])
def test_kernel_equals_the_reference(vocab, temperature, min_p):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(24, vocab, generator=g) * 4
    sb = batch(24, vocab, temperature, min_p)
    ref = sample_reference(logits, sb)
    t = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones(24))
    tokens, logprobs = OPS.sample_rows(logits, t, sb.min_ps, sb.uniforms,
                                       (sb.temperatures == 0).to(torch.uint8))
    assert tokens.tolist() == ref.token_ids
    want = torch.log_softmax(logits.double() / t.double()[:, None], -1).gather(
        1, tokens[:, None]).squeeze(1)
    assert (logprobs.double() - want).abs().max() < 2e-6
    assert logprobs.tolist() == pytest.approx(ref.logprobs, abs=1e-5)


def test_kernel_frequencies_match_softmax():
    """Many uniforms through one row: the kernel's draws follow softmax(x / T) after min-p."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    n, t, min_p = 20000, 0.8, 0.05
    rows = logits.expand(n, -1).contiguous()
    u = torch.tensor([uniform_for(11, k) for k in range(n)], dtype=torch.float64)
    tokens, _ = OPS.sample_rows(rows, torch.full((n,), t), torch.full((n,), min_p), u,
                                torch.zeros(n, dtype=torch.uint8))
    p = torch.softmax(logits.double() / t, -1)
    p = torch.where(p >= p.max() * min_p, p, 0.0)
    p = p / p.sum()
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[p == 0].sum() == 0
    kept = p > 0
    stat = float(((counts[kept] - n * p[kept]) ** 2 / (n * p[kept])).sum())
    assert stat < 22.458   # chi-square, 6 dof, p = 0.001


def test_kernel_handles_strided_rows_and_refuses_bad_input():
    wide = torch.randn(4, 300)
    logits = wide[:, :200]          # row stride 300
    sb = batch(4, 200, 1.0)
    one = torch.ones(4)
    tokens, _ = OPS.sample_rows(logits, one, sb.min_ps, sb.uniforms,
                                torch.zeros(4, dtype=torch.uint8))
    assert tokens.tolist() == sample_reference(logits.contiguous(), sb).token_ids
    with pytest.raises(ValueError, match="sample_rows"):
        OPS.sample_rows(logits, torch.zeros(4), sb.min_ps, sb.uniforms,
                        torch.zeros(4, dtype=torch.uint8))      # T = 0 reaches the kernel
    with pytest.raises(ValueError, match="sample_rows"):
        OPS.sample_rows(logits, one[:3], sb.min_ps, sb.uniforms,
                        torch.zeros(4, dtype=torch.uint8))


def test_a_row_draws_the_same_token_whichever_path_its_neighbours_take():
    """Rows 0-3 are kernel rows; the rest need the reference (top-k, top-p, penalties). The
    kernel rows' tokens equal those drawn with only kernel rows in the batch."""
    vocab = 500
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=g) * 3
    sb = batch(8, vocab, [1.0, 0.7, 0.0, 1.3, 1.0, 1.0, 0.9, 1.0],
               min_p=[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
               top_k=[vocab, vocab, vocab, vocab, 20, vocab, vocab, vocab],
               top_p=[1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0, 1.0],
               penalties=Penalties(rows=torch.tensor([6, 7]), ids=torch.tensor([4, 9]),
                                   bias=torch.tensor([-2.0, -1.5])))
    mixed = sample(logits.clone(), sb)
    alone = sample(logits[:4].clone(), batch(4, vocab, [1.0, 0.7, 0.0, 1.3],
                                            min_p=[0.0, 0.1, 0.0, 0.0]))
    assert mixed.token_ids[:4] == alone.token_ids
    assert mixed.logprobs[:4] == pytest.approx(alone.logprobs, abs=1e-5)
    ref = sample_reference(logits.clone(), sb)
    assert mixed.token_ids[4:] == ref.token_ids[4:]


def test_top_logprobs_agree_with_the_returned_logprob():
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * 2
    sb = batch(6, vocab, 0.9, top_logprobs_num=[0, 5, 0, 3, 0, 1])
    out = sample(logits, sb)
    assert out.top_logprobs is not None
    for i, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert len(top) == sb.top_logprobs_num[i]
        for v, t in top:
            if t == tok:
                assert v == lp
    ref = sample_reference(logits, sb)
    assert out.token_ids == ref.token_ids
    for got, want in zip(out.top_logprobs, ref.top_logprobs or []):
        assert [t for _, t in got] == [t for _, t in want]


def _penalties(n: int, vocab: int, seed: int) -> Penalties:
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n).repeat_interleave(5)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:5] for _ in range(n)]).reshape(-1)
    return Penalties(rows=rows, ids=ids,
                     repetition=torch.full((5 * n,), 1.3),
                     bias=-torch.rand(5 * n, generator=g) * 3,
                     banned=(torch.arange(0, n, 2), torch.zeros(-(-n // 2), dtype=torch.int64)))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_penalised_rows_equal_the_reference(temperature):
    """Penalties (repetition, frequency / presence bias, min_new_tokens bans) in the kernel:
    the same tokens as the reference, logprobs of the unpenalised row."""
    vocab, n = 700, 16
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(9)) * 3
    logits[:, 0] += 6      # the banned id 0 would be a likely token
    sb = batch(n, vocab, temperature, penalties=_penalties(n, vocab, 4))
    out = sample(logits.clone(), sb)
    ref = sample_reference(logits.clone(), sb)
    assert out.token_ids == ref.token_ids
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert all(out.token_ids[i] != 0 for i in range(0, n, 2))
    t = 1.0 if temperature == 0 else temperature
    want = torch.log_softmax(logits.double() / t, -1)[torch.arange(n), out.token_ids]
    assert (torch.tensor(out.logprobs).double() - want).abs().max() < 2e-6


def test_a_banned_token_is_never_drawn_even_holding_the_mass():
    vocab, n = 50, 400
    logits = torch.zeros(n, vocab)
    logits[:, 7] = 30.0                                  # all but all of the mass
    sb = batch(n, vocab, 1.0, penalties=Penalties(
        rows=torch.zeros(0, dtype=torch.int64), ids=torch.zeros(0, dtype=torch.int64),
        banned=(torch.arange(n), torch.full((n,), 7))))
    sb.uniforms = torch.linspace(0, 1 - 1e-12, n, dtype=torch.float64)
    out = sample(logits, sb)
    assert 7 not in out.token_ids
    want = -math.log(math.exp(30.0) + vocab - 1)        # the unpenalised row's logprob
    assert out.logprobs == pytest.approx([want] * n, abs=1e-5)


def test_penalty_entries_merge_by_row_with_bans_last():
    """The kernel's CSR: per row the penalty entries, then the bans (a ban of a penalised id
    wins); parts out of row order are placed all the same."""
    from rollout_engine.penalties import merge_by_row

    pens = (torch.tensor([0, 0, 2, 1]), torch.tensor([5, 6, 7, 8]),
            torch.tensor([1.0, 2.0, 3.0, 4.0]))
    bans = (torch.tensor([0, 2]), torch.tensor([6, 9]), torch.full((2,), float("-inf")))
    offsets, ids, values = merge_by_row([pens, bans], 3)
    assert offsets.tolist() == [0, 3, 4, 6]
    assert ids.tolist() == [5, 6, 6, 8, 7, 9]
    assert values.tolist() == [1.0, 2.0, float("-inf"), 4.0, 3.0, float("-inf")]
    vocab = 12
    logits = torch.zeros(3, vocab)
    logits[0, 6] = 50.0                       # penalised to 2.0, then banned
    sb = batch(3, vocab, 1.0)
    t, _ = OPS.sample_rows(logits, torch.ones(3), sb.min_ps, sb.uniforms,
                           torch.ones(3, dtype=torch.uint8), (offsets, ids, values))
    assert t.tolist() == [5, 8, 7]            # greedy over the patched rows


def test_a_penalty_that_moves_the_mass_keeps_the_unpenalised_logprob():
    """A large positive bias (a negative frequency penalty) makes its token the whole sampling
    mass: the normaliser of the unpenalised row is then recomputed, not patched."""
    vocab, n = 300, 6
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2))
    pen = Penalties(rows=torch.arange(n), ids=torch.full((n,), 11),
                    bias=torch.full((n,), 40.0))
    sb = batch(n, vocab, [1.0, 0.8, 1.0, 1.3, 0.0, 1.0], penalties=pen)
    out = sample(logits.clone(), sb)
    assert out.token_ids == [11] * n
    ref = sample_reference(logits.clone(), sb)
    assert out.token_ids == ref.token_ids
    t = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones(n)).double()
    want = torch.log_softmax(logits.double() / t[:, None], -1)[:, 11]
    assert (torch.tensor(out.logprobs).double() - want).abs().max() < 2e-6


@pytest.mark.parametrize("top_k", [2, 7, 50, 499])
@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.0), (0.6, 0.05)])
def test_top_k_rows_in_the_kernel_equal_the_reference(top_k, temperature, min_p):
    vocab, n = 500, 32
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(top_k)) * 3
    sb = batch(n, vocab, temperature, min_p=min_p, top_k=top_k)
    out, ref = sample(logits, sb), sample_reference(logits, sb)
    assert out.token_ids == ref.token_ids
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    kept = logits.topk(top_k, dim=-1).indices
    assert all(t in kept[i].tolist() for i, t in enumerate(out.token_ids))


def test_top_k_ties_at_the_cut_keep_the_lowest_ids():
    """k = 3 over [5, 1, 1, 1, 1, ...]: the kept set is {0, 1, 2} (a stable sort's), never the
    later ids of the tied group, whatever the uniform."""
    vocab, n = 40, 2000
    row = torch.zeros(vocab)
    row[0] = 5.0
    row[1:6] = 1.0
    logits = row.expand(n, -1).contiguous()
    sb = batch(n, vocab, 1.0, top_k=3)
    sb.uniforms = torch.linspace(0, 1 - 1e-12, n, dtype=torch.float64)
    out = sample(logits, sb)
    assert set(out.token_ids) == {0, 1, 2}
    assert out.token_ids == sample_reference(logits, sb).token_ids


def test_penalised_top_k_rows_take_the_reference_path():
    """Top-k is cut on the penalised logits: such rows stay on the reference path, and the
    batch still equals the reference."""
    vocab, n = 200, 8
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)) * 2
    best = logits.argmax(dim=-1)
    pen = Penalties(rows=torch.arange(n), ids=best, bias=torch.full((n,), -20.0))
    sb = batch(n, vocab, 1.0, top_k=[1, 3, 3, 3, vocab, vocab, 5, 5], penalties=pen)
    out, ref = sample(logits.clone(), sb), sample_reference(logits.clone(), sb)
    assert out.token_ids == ref.token_ids
    assert all(t != int(b) for t, b in zip(out.token_ids, best))
