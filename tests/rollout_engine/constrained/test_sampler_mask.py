"""The sampler under a grammar mask: every option (greedy, plain, min-p, top-k, top-p,
penalties) picks only allowed tokens, greedy rows take the best allowed one, rows without a
grammar are token-identical to a run without the mask, and the returned logprobs stay the
unmasked ones."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.constrained.matcher import TokenMask, bitmask_width, unpack_bitmask
from rollout_engine.penalties import Penalties
from rollout_engine.sampler import SamplingBatch, sample

V = 700   # not a multiple of 32: the last word is partial


def _batch(b: int, seed: int, penalties: bool) -> SamplingBatch:
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 1.0] * (b // 6 + 1))[:b]
    top_ks = torch.tensor([V, V, V, 20, V, 1] * (b // 6 + 1))[:b]
    top_ps = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 1.0] * (b // 6 + 1))[:b]
    min_ps = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0] * (b // 6 + 1))[:b]
    pen = None
    if penalties:
        ids = torch.randint(0, V, (b * 3,), generator=g)
        pen = Penalties(rows=torch.arange(b).repeat_interleave(3), ids=ids,
                        repetition=torch.full((b * 3,), 1.5))
    return SamplingBatch(temps, top_ps, top_ks, min_ps,
                         torch.rand(b, generator=g, dtype=torch.float64), penalties=pen)


@pytest.mark.parametrize("penalties", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_masked_rows_sample_allowed_tokens_only(seed: int, penalties: bool) -> None:
    b = 12
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, V, generator=g) * 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (b, bitmask_width(V)), generator=g,
                            dtype=torch.int64).to(torch.int32)
    # sparse masks on some rows (a grammar at a structural position)
    bitmask[::3] &= torch.randint(0, 2, bitmask[::3].shape, generator=g, dtype=torch.int32)
    rows = [i for i in range(b) if i % 4 != 1]
    for r in rows:
        if not unpack_bitmask(bitmask[r:r + 1], V).any():
            bitmask[r, 0] = 1
    sb = _batch(b, seed, penalties)
    plain = sample(logits.clone(), sb)
    out = sample(logits.clone(), sb, TokenMask(bitmask, rows, V))
    allowed = unpack_bitmask(bitmask, V)
    lp = torch.log_softmax(logits / torch.where(sb.temperatures > 0, sb.temperatures,
                                                torch.ones(b))[:, None], -1)
    for i in range(b):
        t = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(float(lp[i, t]), abs=1e-5)   # unmasked
        if i not in rows:
            assert t == plain.token_ids[i]
            continue
        assert allowed[i, t], (i, t)
        if sb.temperatures[i] == 0 and not penalties:
            assert t == int(logits[i].masked_fill(~allowed[i], float("-inf")).argmax())
