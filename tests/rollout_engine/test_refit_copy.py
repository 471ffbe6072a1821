"""copy_all, the copy behind every refit's apply and bucket pack: byte-exact for plain copies
split over threads and pieces, casts and strided views handled by torch, nothing skipped."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.protocol import bucket


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(1000, 37, generator=g), torch.randn(3, generator=g).to(torch.bfloat16),
            torch.tensor(2.5), torch.empty(0, 4), torch.rand(17, generator=g) > 0.5,
            torch.randn(64, 64, generator=g).t(),               # strided source
            torch.randn(5000, generator=g).to(torch.bfloat16)]  # cast into fp32 below
    dsts = [torch.zeros_like(srcs[0]), torch.zeros_like(srcs[1]), torch.zeros(()),
            torch.zeros(0, 4), torch.zeros(17, dtype=torch.bool), torch.zeros(64, 64),
            torch.zeros(5000)]
    return list(zip(dsts, srcs))


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("piece,parallel_min", [(16 << 20, 32 << 20), (1000, 0), (7, 64)])
def test_copy_all_is_exact(monkeypatch, num_threads, piece, parallel_min):
    monkeypatch.setattr(bucket, "PIECE_BYTES", piece)
    monkeypatch.setattr(bucket, "PARALLEL_MIN_BYTES", parallel_min)
    pairs = _pairs()
    bucket.copy_all(pairs, num_threads=num_threads)
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype)), (dst.dtype, tuple(dst.shape))


def test_copy_all_raises_a_helpers_failure(monkeypatch):
    monkeypatch.setattr(bucket, "PIECE_BYTES", 8)
    monkeypatch.setattr(bucket, "PARALLEL_MIN_BYTES", 0)
    dst = torch.zeros(64)
    readonly = torch.zeros(64)
    calls = {"n": 0}
    real = bucket.np.copyto

    def failing(d, s):
        calls["n"] += 1
        if calls["n"] == 5:
            raise MemoryError("boom")
        real(d, s)

    monkeypatch.setattr(bucket.np, "copyto", failing)
    with pytest.raises(MemoryError, match="boom"):
        bucket.copy_all([(dst, readonly)], num_threads=2)
