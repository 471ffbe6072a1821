"""Storage tier through the tree: blocks written at backup, read back at admission under each
prefetch policy (SGLang's best_effort / wait_complete / timeout), other identities never; a
request whose reads are slow is pending (waits aside) exactly as long as its policy says."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_engine.memory.hicache.hiradix_cache import HiRadixCache
from rollout_engine.memory.hicache.host_pool import HostKVPool
from rollout_engine.memory.hicache.storage import FileStorage
from rollout_engine.memory.hicache.tiers import StorageTier
from rollout_engine.memory.kv_pool import KVPool, PageAllocator
from rollout_engine.memory.prefix_cache import CacheNamespace

NS = CacheNamespace(0)
TOKENS = list(range(40, 60))          # 20 tokens: blocks of 4 -> 5 blocks


class GatedStorage(FileStorage):
    """File storage whose reads (``get``) block until ``gate`` is set: a slow L3 (after 20 s
    the gate opens by itself, so a caller that blocks on it fails instead of hanging)."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        super().__init__(directory, max_bytes)
        self.gate = threading.Event()

    def get(self, key):
        if not self.gate.wait(20):
            self.gate.set()
        return super().get(key)


def _cache(directory, policy="wait_complete", identity=b"model|w1", timeout=(1.0, 0.25),
           storage_cls=FileStorage):
    pool = KVPool(32, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device=torch.device("cpu"))
    allocator = PageAllocator(32, 2)
    host = HostKVPool(pool, 64, 2)
    tier = StorageTier(storage_cls(str(directory), 1 << 24), host, lambda: identity, 4, policy,
                       *timeout)
    return pool, allocator, HiRadixCache(allocator, host, "write_through", tier, page_size=2)


def _fill(directory, identity=b"model|w1"):
    """A first engine computes TOKENS and writes them to storage; returns their K rows."""
    pool, allocator, cache = _cache(directory, identity=identity)
    slots = torch.tensor(allocator.allocate(10))
    pool.k_buffers[1][slots] = torch.randn(20, 1, 4)
    cache.insert(TOKENS, slots, NS)
    cache.close()
    return pool.k_buffers[1][slots].clone()


def test_wait_complete_reads_synchronously_without_a_prefetch(tmp_path):
    want = _fill(tmp_path)
    pool, _, cache = _cache(tmp_path, "wait_complete")
    match = cache.load_back(TOKENS, NS)
    assert match.matched_len == 20 and match.storage_hit_len == 20
    cache.commit_loads()
    assert torch.equal(pool.k_buffers[1][match.slots], want)
    cache.check_integrity()
    cache.close()


def test_best_effort_uses_only_what_the_prefetch_staged(tmp_path):
    want = _fill(tmp_path)
    pool, _, cache = _cache(tmp_path, "best_effort")
    assert cache.load_back(TOKENS, NS).storage_hit_len == 0      # nothing staged yet
    cache.reset()
    cache.prefetch("r", TOKENS, NS)
    cache.flush_storage()                                         # the worker has read them
    match = cache.load_back(TOKENS, NS)
    assert match.storage_hit_len == 20
    cache.commit_loads()
    assert torch.equal(pool.k_buffers[1][match.slots], want)
    cache.close()


def test_timeout_stops_reading_at_the_deadline(tmp_path):
    _fill(tmp_path)
    _, _, cache = _cache(tmp_path, "timeout", timeout=(0.0, 0.0))   # deadline: now
    assert cache.load_back(TOKENS, NS).storage_hit_len == 0
    cache.reset()
    cache.prefetch("r", TOKENS, NS)
    cache.flush_storage()
    assert cache.load_back(TOKENS, NS).storage_hit_len == 20
    cache.close()
    _, _, patient = _cache(tmp_path, "timeout")                      # SGLang's 1 s base
    assert patient.load_back(TOKENS, NS).storage_hit_len == 20
    patient.close()


def test_prefetch_skips_what_the_tree_already_holds(tmp_path):
    _fill(tmp_path)
    pool, allocator, cache = _cache(tmp_path, "best_effort")
    slots = torch.tensor(allocator.allocate(4))
    cache.insert(TOKENS[:8], slots, NS)                               # blocks 0-1 held
    cache.prefetch("r", TOKENS, NS)
    cache.flush_storage()
    assert cache.storage.prefetcher.bytes_read == 3 * 4 * 2 * 2 * 4 * 4   # blocks 2-4 only
    match = cache.load_back(TOKENS, NS)
    assert match.matched_len == 20 and match.storage_hit_len == 12
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_other_identity_never_loads(tmp_path, policy):
    _fill(tmp_path, identity=b"model|w1")
    _, _, cache = _cache(tmp_path, policy, identity=b"model|w2")
    cache.prefetch("r", TOKENS, NS)
    cache.flush_storage()
    assert cache.load_back(TOKENS, NS).matched_len == 0
    assert cache.storage.prefetcher.bytes_read == 0
    cache.close()


@pytest.mark.parametrize("policy,timeout,pending", [
    ("best_effort", (1.0, 0.25), False),      # never waits: admission takes what is staged
    ("wait_complete", (1.0, 0.25), True),     # until the job is done
    ("timeout", (3600.0, 0.0), True),         # until the job is done or the deadline
    ("timeout", (0.0, 0.0), False)])          # deadline passed: admitted with what is staged
def test_pending_while_a_slow_read_runs_by_policy(tmp_path, policy, timeout, pending):
    want = _fill(tmp_path)
    pool, _, cache = _cache(tmp_path, policy, timeout=timeout, storage_cls=GatedStorage)
    cache.prefetch("slow", TOKENS, NS)
    cache.prefetch("miss", [7] * 20, NS)                 # storage lacks it: never pending
    for _ in range(3):                                   # asking again changes nothing
        assert cache.prefetch_pending("slow") is pending
    cache.storage.prefetcher._queries.join()             # the miss was queried meanwhile
    assert not cache.prefetch_pending("miss")
    if not pending:                                      # admitted now: nothing was read yet
        assert cache.load_back(TOKENS, NS).storage_hit_len == 0
    cache.storage.storage.gate.set()
    cache.flush_storage()
    assert not cache.prefetch_pending("slow")            # done: forgotten from here on
    if pending:                                          # admitted once done: every block
        match = cache.load_back(TOKENS, NS)
        assert match.storage_hit_len == 20
        cache.commit_loads()
        assert torch.equal(pool.k_buffers[1][match.slots], want)
    cache.check_integrity()
    cache.close()


def test_forget_prefetch_drops_a_pending_request(tmp_path):
    _fill(tmp_path)
    _, _, cache = _cache(tmp_path, "wait_complete", storage_cls=GatedStorage)
    cache.prefetch("aborted", TOKENS, NS)
    assert cache.prefetch_pending("aborted")
    cache.forget_prefetch("aborted")
    assert not cache.prefetch_pending("aborted")
    cache.storage.storage.gate.set()
    cache.close()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_admission_without_a_prefetch_never_waits_for_storage(tmp_path, policy):
    """The tree lost a prefix after its request arrived (no prefetch covers it): admission
    (load_back with the rid) starts the reads and leaves the request pending, never blocks."""
    want = _fill(tmp_path)
    pool, _, cache = _cache(tmp_path, policy, timeout=(3600.0, 0.0), storage_cls=GatedStorage)
    match = cache.load_back(TOKENS, NS, rid="late")         # would hang here if it read
    assert match.storage_hit_len == 0 and cache.prefetch_pending("late")
    cache.storage.storage.gate.set()
    cache.flush_storage()
    assert not cache.prefetch_pending("late")
    match = cache.load_back(TOKENS, NS, rid="late")
    assert match.storage_hit_len == 20
    cache.commit_loads()
    assert torch.equal(pool.k_buffers[1][match.slots], want)
    cache.check_integrity()
    cache.close()
