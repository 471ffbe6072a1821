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
    monkeypatch.setattr(bucket, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(bucket, "PARALLEL_MIN_BYTES", parallel_min)
    pairs = _pairs()
    bucket.copy_all(pairs, num_threads=num_threads)
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype)), (dst.dtype, tuple(dst.shape))


def test_copy_all_raises_a_helpers_failure(monkeypatch):
    monkeypatch.setattr(bucket, "PIECE_BYTES", 8)
    monkeypatch.setattr(bucket, "MIN_PIECE_BYTES", 1)
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


def test_copies_from_several_threads_share_the_helpers_exactly(monkeypatch):
    """The helper threads persist across calls and serve every caller in turn: copies made
    from four threads at once, many times, are all exact (and a helper's failure above left
    them serving)."""
    import threading

    monkeypatch.setattr(bucket, "MIN_PIECE_BYTES", 1 << 10)
    monkeypatch.setattr(bucket, "PARALLEL_MIN_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    jobs = [[(torch.zeros(4096 + 13 * i), torch.randn(4096 + 13 * i, generator=g))
             for i in range(8)] for _ in range(4)]
    bad: list[int] = []

    def worker(k: int) -> None:
        for _ in range(25):
            for dst, _ in jobs[k]:
                dst.zero_()
            bucket.copy_all(jobs[k], num_threads=3)
            if not all(torch.equal(d, s) for d, s in jobs[k]):
                bad.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad and not any(t.is_alive() for t in threads)
