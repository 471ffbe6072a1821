"""Storage prefetch on background threads: blocks read while their request waits aside.

A request's arrival queues a job (its block keys after what the tree already holds). Two
stages, as SGLang's controller splits them, so a request whose blocks storage lacks is never
held up by another request's long read::

    submit -> [query thread]  count the leading keys storage holds (exists only)
                 | 0 hits: done at once          | n hits
                 v                               v
                done                      [io thread]  read the n blocks, in order, into a
                                                       bounded staging area of bytes -> done

Reads stop at the first block storage lacks (a prefix is useful only up to its first hole).
Admission takes staged blocks by key; whether a request waits for its job meanwhile is the
prefetch policy's (``tiers.py``): the scheduler keeps admitting the requests behind it.

Only bytes cross the thread boundary: the workers never touch the tree or the host pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Optional

from rollout_engine.memory.hicache.storage import HiCacheStorage

__all__ = ["PrefetchJob", "Prefetcher"]

logger = logging.getLogger(__name__)


class PrefetchJob:
    """One request's keys (``num_tokens`` tokens of KV); ``done`` is set once the workers have
    read all they could. ``num_hits``: leading keys storage held (None until queried)."""

    def __init__(self, keys: list[str], num_tokens: int) -> None:
        self.keys = keys
        self.num_tokens = num_tokens
        self.submitted = time.monotonic()
        self.num_hits: Optional[int] = None
        self.done = threading.Event()


class Prefetcher:
    """A query thread, an io thread and a staging area bounded to ``max_bytes`` (oldest
    dropped first)."""

    def __init__(self, storage: HiCacheStorage, max_bytes: int, max_jobs: int = 4096) -> None:
        self.storage = storage
        self.max_bytes = max_bytes
        self._staged: OrderedDict[str, bytes] = OrderedDict()
        self._staged_bytes = 0
        self._job_of: OrderedDict[str, PrefetchJob] = OrderedDict()   # key -> its latest job
        self._max_jobs = max_jobs
        self._lock = threading.Lock()
        self._queries: queue.Queue[Optional[PrefetchJob]] = queue.Queue()
        self._reads: queue.Queue[Optional[PrefetchJob]] = queue.Queue()
        self.bytes_read = 0
        self._threads = [
            threading.Thread(target=self._query, name="hicache-prefetch-query", daemon=True),
            threading.Thread(target=self._read, name="hicache-prefetch-io", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, keys: list[str], num_tokens: int) -> PrefetchJob:
        job = PrefetchJob(keys, num_tokens)
        with self._lock:
            for key in keys:
                self._job_of[key] = job
                self._job_of.move_to_end(key)
            while len(self._job_of) > self._max_jobs:
                self._job_of.popitem(last=False)
        self._queries.put(job)
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
        """Until every submitted job has been queried and read (tests, shutdown)."""
        self._queries.join()     # a queried job is queued for reading before task_done
        self._reads.join()

    def close(self) -> None:
        self._queries.put(None)   # the query thread passes it on to the io thread
        for t in self._threads:
            t.join()

    def _stage(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._staged:
                return
            self._staged[key] = data
            self._staged_bytes += len(data)
            while self._staged_bytes > self.max_bytes and self._staged:
                _, old = self._staged.popitem(last=False)
                self._staged_bytes -= len(old)

    def is_staged(self, key: str) -> bool:
        with self._lock:
            return key in self._staged

    def _exists(self, key: str) -> bool:
        try:
            return self.storage.exists(key)
        except Exception:  # noqa: BLE001 - a failing backend reads as a miss, never a hang
            logger.exception("hicache storage exists(%s) failed", key)
            return False

    def _get(self, key: str) -> Optional[bytes]:
        try:
            return self.storage.get(key)
        except Exception:  # noqa: BLE001
            logger.exception("hicache storage get(%s) failed", key)
            return None

    def _query(self) -> None:
        while True:
            job = self._queries.get()
            try:
                if job is None:
                    self._reads.put(None)
                    return
                hits = 0
                for key in job.keys:
                    if not (self.is_staged(key) or self._exists(key)):
                        break
                    hits += 1
                job.num_hits = hits
                if hits:
                    self._reads.put(job)
                else:
                    job.done.set()
            finally:
                self._queries.task_done()

    def _read(self) -> None:
        while True:
            job = self._reads.get()
            try:
                if job is None:
                    return
                for key in job.keys[:job.num_hits]:
                    if self.is_staged(key):
                        continue
                    data = self._get(key)
                    if data is None:
                        break
                    self.bytes_read += len(data)
                    self._stage(key, data)
            finally:
                if job is not None:
                    job.done.set()
                self._reads.task_done()
