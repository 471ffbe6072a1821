"""The storage tier as the tree sees it: block keys per namespace, writes of backed-up nodes,
fetches into the host tier on admission, under SGLang's prefetch policies.

Blocks are ``block_tokens`` long and aligned to the start of the sequence; a node's backup
writes the blocks that end inside it (its ancestors wrote the ones before), gathering rows from
every host copy on its path::

    tokens   |<-- A -->|<------- B ------->|         backup(B) writes blocks 1 and 2
    blocks   |   0   |   1   |   2   |  3 ...        block 3 is not whole yet: not written

A fetch reads the consecutive blocks after a match (the first one may start before the match:
its leading rows are skipped) into fresh host slots as one host-only node.

Prefetch (SGLang's policies): a request's arrival queues its blocks after what the tree holds
on the prefetch threads (``prefetch.py``). While ``prefetch_pending`` says so, the scheduler
leaves the request waiting aside and admits the ones behind it; once it is admitted, the fetch
takes what is staged. By policy: ``best_effort`` never pending (admission takes what is staged
by then); ``wait_complete`` pending until the job is done (a block staging dropped meanwhile
is read at admission); ``timeout`` pending until the job is done or SGLang's deadline has
passed (``base + per_ki_token * tokens / 1024`` seconds after the job was queued), then only
what is staged. A caller that fetches without asking first (tests) waits for the job there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from rollout_engine.memory.hicache.host_pool import HostKVPool
from rollout_engine.memory.hicache.node import HiTreeNode, HostTree
from rollout_engine.memory.hicache.prefetch import Prefetcher, PrefetchJob
from rollout_engine.memory.hicache.storage import HiCacheStorage, StorageWriter, block_keys
from rollout_engine.memory.prefix_cache import CacheNamespace
from rollout_engine.memory.radix_node import TreeNode

__all__ = ["PREFETCH_POLICIES", "StorageTier"]

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
_MAX_TRACKED = 4096   # requests whose prefetch is tracked at once


class StorageTier:
    """L3 for one engine: ``identity()`` fingerprints the weights now serving (called only
    while the namespace's generation is live, so it sees that generation's weights)."""

    def __init__(self, storage: HiCacheStorage, host: HostKVPool,
                 identity: Callable[[], bytes], block_tokens: int,
                 prefetch_policy: str = "best_effort", timeout_base: float = 1.0,
                 timeout_per_ki_token: float = 0.25) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy must be one of "
                             f"{PREFETCH_POLICIES}, got {prefetch_policy!r}")
        if block_tokens < 1 or block_tokens % host.page_size:
            raise ValueError(f"storage block of {block_tokens} tokens is not whole pages of "
                             f"{host.page_size}")
        self.storage = storage
        self.host = host
        self.block_tokens = block_tokens
        self.prefetch_policy = prefetch_policy
        self.timeout = (timeout_base, timeout_per_ki_token)
        self.writer = StorageWriter(storage)
        self.prefetcher = Prefetcher(storage, max(host.nbytes() // 2, 1))
        self._closed = False
        self._weights_identity = identity
        self._identities: dict[CacheNamespace, bytes] = {}
        self._live: Optional[int] = None
        self.bytes_read = 0
        self.num_fetches = 0
        self.fetch_seconds = 0.0
        self.blocks_submitted = 0
        self._jobs: dict[str, PrefetchJob] = {}   # rid -> its prefetch, until admission

    # -- keys -------------------------------------------------------------------------------------
    def identity(self, namespace: CacheNamespace) -> Optional[bytes]:
        """The key prefix of ``namespace``'s blocks; None once its generation is retired."""
        if self._live is not None and namespace.generation < self._live:
            return None
        ident = self._identities.get(namespace)
        if ident is None:
            extra = (namespace.extra_key or "").encode()
            ident = self._weights_identity() + b"|extra=" + extra
            self._identities[namespace] = ident
        return ident

    def forget_before(self, generation: Optional[int]) -> None:
        """A weight change (generation) or a flush (None): identities are fingerprinted again."""
        if generation is not None and (self._live is None or generation > self._live):
            self._live = generation
        self._identities.clear()

    # -- writes -----------------------------------------------------------------------------------
    def write_node(self, cache: HostTree, node: TreeNode) -> None:
        """Queue the whole blocks that end inside ``node`` (just backed up)."""
        chain = []
        n = node
        while n.key:
            chain.append(n)
            assert n.parent is not None
            n = n.parent
        chain.reverse()
        namespace = _namespace_of(cache, n)
        B = self.block_tokens
        end = sum(len(c.key) for c in chain)
        first, last = (end - len(node.key)) // B, end // B
        if namespace is None or first >= last:
            return
        ident = self.identity(namespace)
        if ident is None:
            return
        tokens = [t for c in chain for t in c.key]
        host_slots = torch.cat([c.host_value for c in chain])  # type: ignore[attr-defined]
        for b, key in enumerate(block_keys(ident, tokens, B, last)):
            if b >= first and not self.storage.exists(key):
                self.writer.submit(key, self.host.read_rows(host_slots[b * B:(b + 1) * B]))
                self.blocks_submitted += 1

    # -- reads ------------------------------------------------------------------------------------
    def prefetch(self, rid: str, namespace: CacheNamespace, key: tuple[int, ...],
                 held: int) -> None:
        """Queue the blocks of ``key`` after its first ``held`` tokens (what the tree holds)
        as request ``rid``'s job."""
        self._jobs.pop(rid, None)
        ident = self.identity(namespace)
        B = self.block_tokens
        first, total = held // B, len(key) // B
        if ident is None or first >= total:
            return
        self._jobs[rid] = self.prefetcher.submit(block_keys(ident, key, B, total)[first:],
                                                 (total - first) * B)
        while len(self._jobs) > _MAX_TRACKED:   # callers that never ask (bounded all the same)
            del self._jobs[next(iter(self._jobs))]

    def prefetch_pending(self, rid: str) -> bool:
        """True while the policy has request ``rid`` wait for its reads before admission; the
        first False forgets the job (SGLang's check_prefetch_progress)."""
        job = self._jobs.get(rid)
        if job is None:
            return False
        if self.prefetch_policy == "best_effort" or job.done.is_set() or (
                self.prefetch_policy == "timeout" and time.monotonic() >= self._deadline(job)):
            del self._jobs[rid]
            return False
        return True

    def wait_prefetch(self, timeout: float) -> None:
        """Until some tracked job is done, or ``timeout`` seconds (nothing else can run)."""
        for job in self._jobs.values():
            if not job.done.is_set():
                job.done.wait(timeout)
                return

    def forget_prefetch(self, rid: str) -> None:
        self._jobs.pop(rid, None)

    def _deadline(self, job: PrefetchJob) -> float:
        base, per_ki = self.timeout
        return job.submitted + base + per_ki * job.num_tokens / 1024

    def fetch_after(self, cache: HostTree, namespace: CacheNamespace, parent: TreeNode,
                    key: tuple[int, ...], pos: int,
                    rid: Optional[str] = None) -> Optional[HiTreeNode]:
        """Read the blocks storage holds after ``key[:pos]`` into a new host-only child of
        ``parent`` (backed up first: host-held nodes stay closed under ancestors); None if
        there is none, or no host room. With ``rid`` (the scheduler's admission) it never
        waits: blocks no finished job has read make ``rid`` pending on the job that reads
        them (a new one if none is), and None is returned for now."""
        t0 = time.perf_counter()
        ident = self.identity(namespace)
        B = self.block_tokens
        first, total = pos // B, len(key) // B
        if ident is None or first >= total:
            return None
        if parent.key and parent.host_value is None:  # type: ignore[attr-defined]
            if not cache.backup(parent):  # type: ignore[arg-type]
                return None
        keys = block_keys(ident, key, B, total)[first:]
        if rid is not None and self._defer(rid, keys, len(key) - pos):
            return None
        blocks = self._read(keys, len(key) - pos, wait=rid is None)
        if not blocks:
            return None
        end = (first + len(blocks)) * B
        host_slots = cache.alloc_host(end - pos)
        if host_slots is None:
            return None
        offset = 0
        for i, data in enumerate(blocks):
            skip = pos - first * B if i == 0 else 0
            rows = B - skip
            self.host.write_rows(host_slots[offset:offset + rows], data, skip)
            offset += rows
            self.bytes_read += len(data)
        self.num_fetches += 1
        self.fetch_seconds += time.perf_counter() - t0
        return cache.attach_host_node(parent, key[pos:end], host_slots)

    def _defer(self, rid: str, keys: list[str], num_tokens: int) -> bool:
        """True if admission should not read ``keys`` now: no finished (or, for ``timeout``,
        timed-out) job has read them; ``rid`` is then pending on the job that will."""
        if self.prefetch_policy == "best_effort":
            return False
        job = self.prefetcher.job_of(keys[-1]) or self.prefetcher.job_of(keys[0])
        if job is None:
            if self.prefetcher.is_staged(keys[0]):   # read by a job no longer tracked
                return False
            job = self.prefetcher.submit(keys, num_tokens)
        elif job.done.is_set() or (self.prefetch_policy == "timeout"
                                   and time.monotonic() >= self._deadline(job)):
            return False
        self._jobs[rid] = job
        return True

    def _read(self, keys: list[str], num_tokens: int, wait: bool = True) -> list[bytes]:
        """The leading run of ``keys`` available under the prefetch policy (``wait``: for a
        job still reading them, as a caller that never asks ``prefetch_pending`` needs)."""
        policy = self.prefetch_policy
        base, per_ki = self.timeout
        job = self.prefetcher.job_of(keys[-1])
        now = time.monotonic()
        deadline = (self._deadline(job) if job is not None
                    else now + base + per_ki * num_tokens / 1024)
        if wait and job is not None and policy != "best_effort" and not job.done.is_set():
            job.done.wait(None if policy == "wait_complete" else max(0.0, deadline - now))
        blocks: list[bytes] = []
        for key in keys:
            data = self.prefetcher.take(key)
            if data is None and (policy == "wait_complete"
                                 or policy == "timeout" and time.monotonic() < deadline):
                data = self.storage.get(key) if self.storage.exists(key) else None
            if data is None:
                break
            blocks.append(data)
        return blocks

    # -- lifecycle --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"storage_bytes_read": self.bytes_read,
                "storage_bytes_prefetched": self.prefetcher.bytes_read,
                "storage_bytes_written": self.writer.bytes_written,
                "storage_blocks_submitted": self.blocks_submitted,
                "storage_blocks_dropped": self.writer.num_dropped,
                "storage_fetches": self.num_fetches,
                "storage_fetch_seconds": self.fetch_seconds}

    def delete_own(self) -> int:
        """Delete every block this engine wrote (a flush that asks for it); returns how many.
        Blocks other engines wrote stay, as do ours that another engine also wrote."""
        self.flush()
        written = self.writer.written
        for key in written:
            self.storage.delete(key)
        num = len(written)
        written.clear()
        self.prefetcher.drop_staged()
        return num

    def reset(self, delete_own: bool) -> None:
        """The cache was flushed: identities are fingerprinted again, and this returns with L3
        settled: the blocks this engine wrote deleted (``delete_own``), else every block
        queued before it stored (the writer thread may still be behind)."""
        self.forget_before(None)
        if delete_own:
            self.delete_own()
        else:
            self.flush()

    def flush(self) -> None:
        """Until every queued write is stored and every queued prefetch read."""
        self.writer.flush()
        self.prefetcher.wait_idle()

    def close(self) -> None:
        """Flush and stop both threads (idempotent: an engine may be shut down twice)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self.writer.close()
        self.prefetcher.close()


def _namespace_of(cache: HostTree, ns_root: TreeNode) -> Optional[CacheNamespace]:
    for namespace, candidate in cache.root.children.items():
        if candidate is ns_root:
            return namespace  # type: ignore[return-value]
    return None
