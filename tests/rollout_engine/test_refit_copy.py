"""copy_all, the copy behind every refit's apply and bucket pack: byte-exact for plain copies
split over threads and pieces (numpy's memcpy or the streaming-store kernel), casts and
strided views handled by torch, nothing skipped; a stalled helper never holds a copy back."""

from __future__ import annotations

import logging
import platform
import threading

import numpy as np
import pytest
import torch
from rollout_engine_kernels.cpu import build, stream_copy

from rollout_engine.protocol import byte_copy


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


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("piece,parallel_min", [(16 << 20, 32 << 20), (1000, 0), (7, 64)])
def test_copy_all_is_exact(monkeypatch, num_threads, piece, parallel_min, stream):
    monkeypatch.setattr(byte_copy, "PIECE_BYTES", piece)
    monkeypatch.setattr(byte_copy, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(byte_copy, "PARALLEL_MIN_BYTES", parallel_min)
    monkeypatch.setattr(byte_copy, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    if stream:   # every dev and CI machine has gcc: the kernel must build
        assert stream_copy.load_stream_copy() is not None
    pairs = _pairs()
    byte_copy.copy_all(pairs, num_threads=num_threads)
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype)), (dst.dtype, tuple(dst.shape))


def test_copy_all_raises_a_helpers_failure(monkeypatch):
    monkeypatch.setattr(byte_copy, "PIECE_BYTES", 8)
    monkeypatch.setattr(byte_copy, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(byte_copy, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(byte_copy, "STREAM_MIN_BYTES", 1 << 62)
    dst = torch.zeros(64)
    readonly = torch.zeros(64)
    calls = {"n": 0}
    real = byte_copy._memcpy

    def failing(d, s, n):
        calls["n"] += 1
        if calls["n"] == 5:
            raise MemoryError("boom")
        real(d, s, n)

    monkeypatch.setattr(byte_copy, "_memcpy", failing)
    with pytest.raises(MemoryError, match="boom"):
        byte_copy.copy_all([(dst, readonly)], num_threads=2)


@pytest.mark.parametrize("helpers", ["python", "library"])
def test_copies_from_several_threads_share_the_helpers_exactly(monkeypatch, helpers):
    """The helper threads persist across calls and serve every caller in turn: copies made
    from four threads at once, many times, are all exact (and a helper's failure above left
    them serving). "python": byte_copy's helpers (copies under STREAM_MIN_BYTES); "library": the
    streaming-copy library's own (one caller served at a time, the others copying alone)."""
    if helpers == "python":
        monkeypatch.setattr(byte_copy, "MIN_PIECE_BYTES", 1 << 10)
        monkeypatch.setattr(byte_copy, "PARALLEL_MIN_BYTES", 0)
    else:
        monkeypatch.setattr(byte_copy, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(byte_copy, "NATIVE_PIECE_BYTES", 4096)
        assert stream_copy.load_stream_copy() is not None
    g = torch.Generator().manual_seed(1)
    jobs = [[(torch.zeros(4096 + 13 * i), torch.randn(4096 + 13 * i, generator=g))
             for i in range(8)] for _ in range(4)]
    bad: list[int] = []

    def worker(k: int) -> None:
        for _ in range(25):
            for dst, _ in jobs[k]:
                dst.zero_()
            byte_copy.copy_all(jobs[k], num_threads=3)
            if not all(torch.equal(d, s) for d, s in jobs[k]):
                bad.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad and not any(t.is_alive() for t in threads)


def test_stream_copy_is_exact_at_every_alignment():
    """The kernel's aligned middle, plain head and tail: every destination and source offset
    in a 64-byte line, lengths around the 16- and 64-byte steps; not a byte written outside
    the range."""
    op = stream_copy.load_stream_copy()
    assert op is not None
    assert op.streams == (platform.machine() in ("x86_64", "AMD64"))
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 8192, dtype=np.uint8)
    for length in (0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4097):
        for d_off in range(0, 64, 7):
            for s_off in (0, 1, 13, 32):
                dst = np.full(8192, 0xAB, dtype=np.uint8)
                op.copy(dst.ctypes.data + 128 + d_off, src.ctypes.data + s_off, length)
                want = np.full(8192, 0xAB, dtype=np.uint8)
                want[128 + d_off:128 + d_off + length] = src[s_off:s_off + length]
                assert np.array_equal(dst, want), (length, d_off, s_off)


def test_a_stalled_helper_does_not_hold_the_copy_back(monkeypatch):
    """A helper busy elsewhere (here: blocked on an event) takes no piece: the calling thread
    copies them all and returns, exact, while the helper is still stuck."""
    monkeypatch.setattr(byte_copy, "PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(byte_copy, "MIN_PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(byte_copy, "PARALLEL_MIN_BYTES", 0)
    release = threading.Event()
    stuck = byte_copy._HELPERS.run(0, lambda: release.wait(60))
    try:
        dst, src = torch.zeros(1 << 16), torch.randn(1 << 16)
        byte_copy.copy_all([(dst, src)], num_threads=2)
        assert torch.equal(dst, src) and not stuck.is_set()
    finally:
        release.set()
    assert stuck.wait(60)
    dst.zero_()   # the helper serves again, and the copy it missed did not run late
    byte_copy.copy_all([(dst, src)], num_threads=2)
    assert torch.equal(dst, src)


def test_without_the_kernel_copies_stay_exact(monkeypatch, caplog):
    """Turned off, or failing to build: one warning (none when turned off), numpy's memcpy."""
    stream_copy.load_stream_copy.cache_clear()
    try:
        monkeypatch.setenv(stream_copy.STREAM_COPY_ENV, "0")
        assert stream_copy.load_stream_copy() is None
        stream_copy.load_stream_copy.cache_clear()
        monkeypatch.delenv(stream_copy.STREAM_COPY_ENV)

        def broken(*args, **kwargs):
            raise RuntimeError("no compiler")

        monkeypatch.setattr(build, "build_library", broken)
        with caplog.at_level(logging.WARNING):
            assert stream_copy.load_stream_copy() is None
        assert "streaming copy unavailable" in caplog.text and "no compiler" in caplog.text
        monkeypatch.setattr(byte_copy, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(byte_copy, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(byte_copy, "MIN_PIECE_BYTES", 1 << 10)
        dst, src = torch.zeros(1 << 14), torch.randn(1 << 14)
        byte_copy.copy_all([(dst, src)], num_threads=2)
        assert torch.equal(dst, src)
    finally:
        stream_copy.load_stream_copy.cache_clear()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("piece", [100, 4096, 1 << 20])
def test_copy_ranges_is_exact_and_writes_nothing_else(threads, piece, stream):
    """The library's many-range copy (copy_all's path for large copies): ranges of every size
    around the piece size at odd offsets, shared by its own threads; every byte outside the
    ranges keeps its value."""
    op = stream_copy.load_stream_copy()
    assert op is not None
    rng = np.random.default_rng(threads * 1000 + piece)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.full(3 << 20, 0xAB, dtype=np.uint8)
    want = dst.copy()
    dsts, srcs, sizes, at = [], [], [], 7
    for n in (0, 1, 99, 100, 101, 4095, 4097, 65536, 1 << 20, (1 << 20) + 3, 300_001):
        s_off = int(rng.integers(0, 64))
        dsts.append(dst.ctypes.data + at)
        srcs.append(src.ctypes.data + s_off)
        sizes.append(n)
        want[at:at + n] = src[s_off:s_off + n]
        at += n + 13
    op.copy_ranges(dsts, srcs, sizes, piece, threads, stream)
    assert np.array_equal(dst, want)
    with pytest.raises(ValueError, match="one entry per range"):
        op.copy_ranges(dsts, srcs[:-1], sizes, piece, threads)
