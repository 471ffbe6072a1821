"""Storage prefetch on a background thread: blocks read while their request waits.

A request's arrival queues a job (its block keys after what the tree already holds); one
worker reads them in order into a bounded staging area of bytes, stopping at the first block
storage lacks (a prefix is useful only up to its first hole). Admission takes staged blocks
by key; what it does about blocks not staged yet is the prefetch policy's (``tiers.py``).

Only bytes cross the thread boundary: the worker never touches the tree or the host pool.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from typing import Optional

from rollout_engine.memory.hicache.storage import HiCacheStorage

__all__ = ["PrefetchJob", "Prefetcher"]


class PrefetchJob:
    """One request's keys; ``done`` is set once the worker has read all it could."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.done = threading.Event()


class Prefetcher:
    """One worker thread and a staging area bounded to ``max_bytes`` (oldest dropped first)."""

    def __init__(self, storage: HiCacheStorage, max_bytes: int, max_jobs: int = 4096) -> None:
        self.storage = storage
        self.max_bytes = max_bytes
        self._staged: OrderedDict[str, bytes] = OrderedDict()
        self._staged_bytes = 0
        self._job_of: OrderedDict[str, PrefetchJob] = OrderedDict()   # key -> its latest job
        self._max_jobs = max_jobs
        self._lock = threading.Lock()
        self._queue: queue.Queue[Optional[PrefetchJob]] = queue.Queue()
        self.bytes_read = 0
        self._thread = threading.Thread(target=self._run, name="hicache-prefetch", daemon=True)
        self._thread.start()

    def submit(self, keys: list[str]) -> PrefetchJob:
        job = PrefetchJob(keys)
        with self._lock:
            for key in keys:
                self._job_of[key] = job
                self._job_of.move_to_end(key)
            while len(self._job_of) > self._max_jobs:
                self._job_of.popitem(last=False)
        self._queue.put(job)
        return job

    def job_of(self, key: str) -> Optional[PrefetchJob]:
        with self._lock:
            return self._job_of.get(key)

    def take(self, key: str) -> Optional[bytes]:
        """The staged block (removed from staging), or None."""
        with self._lock:
            data = self._staged.pop(key, None)
            if data is not None:
                self._staged_bytes -= len(data)
            return data

    def drop_staged(self) -> None:
        with self._lock:
            self._staged.clear()
            self._staged_bytes = 0

    def wait_idle(self) -> None:
        """Until every submitted job has been read (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _stage(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._staged:
                return
            self._staged[key] = data
            self._staged_bytes += len(data)
            while self._staged_bytes > self.max_bytes and self._staged:
                _, old = self._staged.popitem(last=False)
                self._staged_bytes -= len(old)

    def _is_staged(self, key: str) -> bool:
        with self._lock:
            return key in self._staged

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                for key in job.keys:
                    if self._is_staged(key):
                        continue
                    data = self.storage.get(key) if self.storage.exists(key) else None
                    if data is None:
                        break
                    self.bytes_read += len(data)
                    self._stage(key, data)
            finally:
                if job is not None:
                    job.done.set()
                self._queue.task_done()
