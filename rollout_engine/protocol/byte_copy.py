"""Copies between tensors for refits and bucket packing: `copy_all` (many pairs, the plain
byte copies shared by threads, large ones with streaming stores) and `copy_into` (one pair).

Every weight a refit writes and every bucket a trainer packs goes through here.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterable

import numpy as np
import torch
from rollout_engine_kernels.cpu.stream_copy import load_stream_copy

__all__ = ["CopyPlan", "copy_all", "copy_into"]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors of one dtype, numpy's memcpy, which
    runs on the calling thread only and releases the GIL (`copy_all` spreads such copies over
    threads)."""
    if _plain_copy(dst, src):
        np.copyto(_bytes(dst), _bytes(src))
    else:
        dst.copy_(src)


PIECE_BYTES = 4 << 20           # copy_all splits plain copies into pieces of at most this
MIN_PIECE_BYTES = 1 << 20       # ... and of at least this (unless a copy is smaller)
PARALLEL_MIN_BYTES = 4 << 20    # ... and uses its helper threads from this many bytes on
STREAM_MIN_BYTES = 4 << 20      # ... and streaming stores from this many bytes on, in
NATIVE_PIECE_BYTES = 1 << 20    # pieces of this size shared by the kernel's own threads


class _Helpers:
    """Persistent helper threads for `copy_all`, started on first use and after a fork: a
    thread started per call costs about as much as copying a megabyte, which a refit sent in
    small buckets would pay on every call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue] = []
        self._pid = -1

    def run(self, index: int, task: Callable[[], None]) -> threading.Event:
        """Run `task` on helper `index` (tasks of one helper run in the order given); the
        event is set once it has returned."""
        with self._lock:
            if self._pid != os.getpid():   # a forked child has the queues but no threads
                self._queues, self._pid = [], os.getpid()
            while len(self._queues) <= index:
                q: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(q,), daemon=True,
                                 name=f"copy-helper-{len(self._queues)}").start()
                self._queues.append(q)
        done = threading.Event()
        self._queues[index].put((task, done))
        return done

    @staticmethod
    def _serve(q: queue.SimpleQueue) -> None:
        while True:
            task, done = q.get()
            try:
                task()
            finally:
                done.set()


_HELPERS = _Helpers()


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], num_threads: int = 2) -> None:
    """`copy_into` for every (dst, src) pair (a `CopyPlan` made and run once), the plain
    byte copies split into pieces shared by `num_threads` threads when there are enough bytes: from `STREAM_MIN_BYTES` on, the
    caller's and the streaming-copy library's own helpers (`StreamCopy.copy_prepared`, a few
    microseconds a call), below it (or without the library) the caller's and persistent Python
    helpers (`_share_out`, ~0.1-0.2 ms a call).

    Why not torch's own parallel copy: a copy is bound by memory bandwidth, and torch's
    OpenMP threads spin at a barrier at the end of every copy_, so on a busy 2-core machine
    a descheduled thread stalls the copy while its partner burns the other core (measured
    2-10x slower under load on a 2-core EPYC). Plain threads copying their own pieces never
    wait for each other until the end. From `STREAM_MIN_BYTES` on, the pieces are copied with
    streaming stores (`stream_copy`: a destination that large is not read before it leaves
    the caches anyway, and skipping its read for ownership saves a third of the traffic).
    """
    CopyPlan(pairs, num_threads).run()


class CopyPlan:
    """`copy_all` of fixed (dst, src) pairs, worked out once: which pairs are plain byte
    copies, which path copies them and, for the streaming-copy library, its range arrays.
    `run` copies them (again), as `copy_all` would now. The plan keeps the tensors alive; it
    is only valid while none of them has been given other storage (the caller's to know:
    `weights.loader.LoadPlan` checks its parameters' storage before each reuse)."""

    def __init__(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 num_threads: int = 2) -> None:
        self.torch_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:   # a cast, another device, a strided view: torch copies it
            (self.whole if _plain_copy(dst, src) else self.torch_pairs).append((dst, src))
        self.total = sum(d.numel() * d.element_size() for d, _ in self.whole)
        self.threads = max(1, num_threads)
        self.stream = load_stream_copy() if self.total >= STREAM_MIN_BYTES else None
        self.ranges = None if self.stream is None else self.stream.ranges(
            [d.data_ptr() for d, _ in self.whole], [s.data_ptr() for _, s in self.whole],
            [d.numel() * d.element_size() for d, _ in self.whole])

    def run(self) -> None:
        for dst, src in self.torch_pairs:
            dst.copy_(src)
        if self.stream is not None:   # the library's own threads share the pieces
            self.stream.copy_prepared(self.ranges, NATIVE_PIECE_BYTES, self.threads)
            return
        if self.threads <= 1 or self.total < PARALLEL_MIN_BYTES:
            for d, s in self.whole:
                np.copyto(_bytes(d), _bytes(s))
            return
        # pieces small enough to balance the threads, big enough to stay cheap; each thread
        # takes the next piece when done with one, so a thread the OS deschedules (a busy
        # 2-core machine: the trainer's own threads, the frontend) holds back only the piece
        # it is on
        piece = min(PIECE_BYTES, max(MIN_PIECE_BYTES, self.total // (8 * self.threads)))
        plain = [(d.data_ptr() + i, s.data_ptr() + i, min(piece, n - i))
                 for d, s in self.whole for n in (d.numel() * d.element_size(),)
                 for i in range(0, n, piece)]
        _share_out(plain, _memcpy, self.threads)


def _share_out(pieces: list[tuple[int, int, int]], copy: Callable[[int, int, int], None],
               threads: int) -> None:
    """Copy every (dst, src, nbytes) piece, this thread and up to `threads - 1` helpers each
    taking the next piece when done with one. A helper that has not started when this thread
    finds no piece left is not waited for (it will find none either), so a helper stuck
    behind the OS scheduler delays the copy by at most the piece it is on."""
    order = itertools.count()   # next() of a count is atomic under the GIL
    state = threading.Condition()
    active = [0]
    closed = [False]
    errors: list[BaseException] = []

    def run() -> None:
        with state:
            if closed[0]:
                return
            active[0] += 1
        try:
            for i in iter(order.__next__, None):
                if i >= len(pieces) or errors:
                    break
                copy(*pieces[i])
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)
        finally:
            with state:
                active[0] -= 1
                state.notify_all()

    for i in range(min(threads, len(pieces)) - 1):
        _HELPERS.run(i, run)
    run()
    with state:
        closed[0] = True      # helpers not yet started return at once
        state.wait_for(lambda: active[0] == 0)
    if errors:
        raise errors[0]


def _memcpy(dst: int, src: int, nbytes: int) -> None:
    """libc's memmove between two raw ranges (a ctypes CFUNCTYPE: it releases the GIL)."""
    ctypes.memmove(dst, src, nbytes)


def _plain_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape
            and not src.requires_grad and not dst.requires_grad and dst.numel() > 0)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()
