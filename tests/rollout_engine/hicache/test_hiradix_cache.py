"""HiRadixCache on its own: write policies, load back of exact KV bytes, host eviction,
namespaces, and every invariant after random operation sequences."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_engine.memory.hicache.hiradix_cache import HiRadixCache
from rollout_engine.memory.hicache.host_pool import HostKVPool, host_pool_slots
from rollout_engine.memory.hicache.storage import FileStorage
from rollout_engine.memory.hicache.tiers import StorageTier
from rollout_engine.memory.kv_pool import KVPool, PageAllocator
from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace
from rollout_engine.memory.radix_node import iter_nodes

NS = CacheNamespace(0)


def _make(policy: str, device_slots: int = 32, host_slots: int = 64, page_size: int = 2,
          storage_dir=None):
    pool = KVPool(device_slots, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device=torch.device("cpu"))
    allocator = PageAllocator(device_slots, page_size)
    host = HostKVPool(pool, host_slots, page_size)
    tier = None if storage_dir is None else StorageTier(
        FileStorage(str(storage_dir), 1 << 20), host, lambda: b"m", 4, "wait_complete")
    return pool, allocator, HiRadixCache(allocator, host, policy, tier, page_size=page_size)


def _compute(pool: KVPool, allocator: PageAllocator, tokens: list[int]) -> torch.Tensor:
    """Fresh slots holding KV that is a function of the token (so a load can be checked)."""
    slots = torch.tensor(allocator.allocate(len(tokens) // allocator.page_size))
    for layer in range(pool.num_layers):
        value = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1) + layer
        pool.k_buffers[layer][slots] = value.expand(-1, 1, 4)
        pool.v_buffers[layer][slots] = -value.expand(-1, 1, 4)
    return slots


def _kv_matches(pool: KVPool, slots: torch.Tensor, tokens: list[int]) -> bool:
    expected = torch.tensor(tokens, dtype=torch.float32)
    return all(torch.equal(pool.k_buffers[i][slots][:, 0, 0], expected + i)
               and torch.equal(pool.v_buffers[i][slots][:, 0, 0], -(expected + i))
               for i in range(pool.num_layers))


def test_write_through_evicts_to_host_and_loads_back_the_same_bytes():
    pool, allocator, cache = _make("write_through")
    tokens = list(range(10, 26))
    assert cache.insert(tokens, _compute(pool, allocator, tokens), NS) == 0
    assert cache.host_size() == 16                    # backed up at insert
    assert cache.evict(16) == 16
    cache.check_integrity()
    assert allocator.available_size() == 32 and cache.match_prefix(tokens, NS).matched_len == 0
    pool.k_buffers[0].zero_()
    match = cache.load_back(tokens, NS)
    assert match.matched_len == 16 and match.host_hit_len == 16
    assert not _kv_matches(pool, match.slots, tokens)   # queued: copied at the commit
    cache.commit_loads()
    assert _kv_matches(pool, match.slots, tokens)
    cache.check_integrity()


def test_write_back_copies_only_on_eviction():
    pool, allocator, cache = _make("write_back")
    tokens = list(range(8))
    cache.insert(tokens, _compute(pool, allocator, tokens), NS)
    assert cache.host_size() == 0
    cache.evict(8)
    assert cache.host_size() == 8
    match = cache.load_back(tokens, NS)
    cache.commit_loads()
    assert _kv_matches(pool, match.slots, tokens)
    cache.check_integrity()


def test_write_through_selective_backs_up_on_the_second_hit():
    pool, allocator, cache = _make("write_through_selective")
    tokens = list(range(8))
    cache.insert(tokens, _compute(pool, allocator, tokens), NS)
    assert cache.host_size() == 0
    cache.evict(8)                                    # one hit only: dropped, not kept
    assert cache.load_back(tokens, NS).matched_len == 0
    cache.insert(tokens, _compute(pool, allocator, tokens), NS)
    cache.load_back(tokens, NS)                       # an admission matches it: hit 2
    assert cache.host_size() == 8
    cache.check_integrity()


def test_host_eviction_drops_least_recent_host_only_leaves():
    pool, allocator, cache = _make("write_through", device_slots=16, host_slots=16)
    a, b, c = [list(range(s, s + 8)) for s in (100, 200, 300)]
    for tokens in (a, b):
        cache.insert(tokens, _compute(pool, allocator, tokens), NS)
        cache.evict(8)
    cache.insert(c, _compute(pool, allocator, c), NS)   # host full: a (oldest) goes
    cache.check_integrity()
    assert cache.load_back(a, NS).matched_len == 0
    assert cache.load_back(b, NS).matched_len == 8
    cache.check_integrity()


def test_retired_generation_and_reset_free_the_host_tier():
    pool, allocator, cache = _make("write_through")
    tokens = list(range(12))
    cache.insert(tokens, _compute(pool, allocator, tokens), NS)
    cache.evict(12)
    assert cache.host_size() == 12
    cache.retire_generations_before(1)
    assert cache.host_size() == 0 and cache.load_back(tokens, NS).matched_len == 0
    cache.insert(tokens, _compute(pool, allocator, tokens), CacheNamespace(1))
    cache.reset()
    assert cache.host_size() == 0 and allocator.available_size() == 32
    cache.check_integrity()


def test_integrity_catches_a_host_slot_owned_twice():
    pool, allocator, cache = _make("write_through")
    a, b = list(range(4)), list(range(50, 54))
    cache.insert(a, _compute(pool, allocator, a), NS)
    cache.insert(b, _compute(pool, allocator, b), NS)
    nodes = [n for n in iter_nodes(cache.root) if n.key]
    nodes[1].host_value = nodes[0].host_value.clone()
    with pytest.raises(CacheIntegrityError, match="host"):
        cache.check_integrity()


def test_host_pool_sizing():
    assert host_pool_slots(100, 4, 2.0, 0, 64) == 200
    assert host_pool_slots(100, 4, 2.0, 1, 2**20) == 1024     # hicache_size wins (GB)
    with pytest.raises(ValueError, match="hicache"):
        host_pool_slots(1, 4, 0.5, 0, 64)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed,storage", [(0, False), (1, False), (2, True), (27, True)])
def test_random_operations_keep_every_invariant(policy, seed, storage, tmp_path):
    rng = random.Random(seed)
    pool, allocator, cache = _make(policy, device_slots=24, host_slots=16,
                                   storage_dir=tmp_path if storage else None)
    locked = []
    bases = [[rng.randrange(4) for _ in range(8)] for _ in range(3)]
    for _ in range(300):
        tokens = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(0, 9))]
        tokens = tokens[:len(tokens) // 2 * 2]
        op = rng.random()
        if op < 0.4:
            match = cache.load_back(tokens, NS)
            if rng.random() < 0.5:   # else the copy stays queued across later operations
                cache.commit_loads()
                assert _kv_matches(pool, match.slots, tokens[:match.matched_len])
            if rng.random() < 0.5 and match.matched_len:
                cache.inc_lock_ref(match.node)
                locked.append(match.node)
        elif op < 0.7:
            need = len(tokens) // 2
            if not allocator.can_allocate(need):
                cache.evict(need * 2 - allocator.available_size())
            if allocator.can_allocate(need):
                slots = _compute(pool, allocator, tokens)
                present = cache.insert(tokens, slots, NS)
                allocator.free(slots[:present])
        elif op < 0.85 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(2, 12))
        cache.check_integrity()
        if rng.random() < 0.3:   # every device node holds its tokens' KV once copies land
            cache.commit_loads()
            for node in iter_nodes(cache.root):
                if node.key and node.value is not None:
                    assert _kv_matches(pool, node.value, list(node.key))
    assert cache.stats.bytes_to_device > 0        # host-only nodes were loaded back
    for node in locked:
        cache.dec_lock_ref(node)
    cache.reset()
    assert allocator.available_size() == 24 and cache.host_size() == 0
    cache.close()


def test_host_pool_copies_scattered_slots_exactly():
    """Backup and load move every layer's K and V of each slot to the right row, in the
    page-first layout, for scattered slots in any order; the byte counts are the rows'."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(40, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"))
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_(generator=gen)
    host = HostKVPool(pool, 64, 1)
    device_slots = torch.randperm(40, generator=gen)[:17]
    host_slots = torch.randperm(64, generator=gen)[:17]
    want_k = [pool.k_buffers[i][device_slots].clone() for i in range(3)]
    want_v = [pool.v_buffers[i][device_slots].clone() for i in range(3)]
    assert host.backup(device_slots, host_slots) == 17 * host.bytes_per_token
    for i in range(3):
        assert torch.equal(host.buffer[host_slots, 0, i], want_k[i])
        assert torch.equal(host.buffer[host_slots, 1, i], want_v[i])
    assert host.buffer[[s for s in range(64) if s not in host_slots.tolist()]].abs().sum() == 0
    for buf in pool.k_buffers + pool.v_buffers:
        buf.zero_()
    target = torch.randperm(40, generator=gen)[:17]
    assert host.load(host_slots, target) == 17 * host.bytes_per_token
    for i in range(3):
        assert torch.equal(pool.k_buffers[i][target], want_k[i])
        assert torch.equal(pool.v_buffers[i][target], want_v[i])
    others = [s for s in range(41) if s not in target.tolist()]
    assert all(buf[others].abs().sum() == 0 for buf in pool.k_buffers + pool.v_buffers)


@pytest.mark.gpu
def test_pinned_host_tier_round_trip_cuda():
    pool = KVPool(32, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16,
                  device=torch.device("cuda"))
    allocator = PageAllocator(32, 2)
    host = HostKVPool(pool, 64, 2)
    assert host.buffer.is_pinned()
    cache = HiRadixCache(allocator, host, "write_through", page_size=2)
    tokens = list(range(16))
    slots = torch.tensor(allocator.allocate(8))
    for layer in range(2):
        pool.k_buffers[layer][slots.cuda()] = torch.randn(16, 1, 4, device="cuda",
                                                          dtype=torch.bfloat16)
    want = pool.k_buffers[1][slots.cuda()].clone()
    cache.insert(tokens, slots, NS)
    cache.evict(16)
    match = cache.load_back(tokens, NS)
    cache.commit_loads()
    assert match.host_hit_len == 16
    assert torch.equal(pool.k_buffers[1][match.slots.cuda()], want)
    cache.check_integrity()


def test_weights_fingerprint_sees_one_changed_element():
    from torch import nn

    from rollout_engine.memory.hicache import weights_fingerprint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 7)).to(torch.bfloat16)
    first = weights_fingerprint(model)
    assert weights_fingerprint(model) == first
    with torch.no_grad():
        model[0].weight[17, 5] += 1.0        # not one of the strided samples
    assert weights_fingerprint(model) != first


def test_reset_returns_with_every_queued_l3_write_stored(tmp_path, monkeypatch):
    """flush_cache without hicache_storage_flush keeps our L3 blocks: when reset returns, every
    block queued before it is on disk, however far behind the writer thread is. The writer is
    held here until somebody waits for it (flush), so a reset that did not wait finds none."""
    import threading

    from rollout_engine.memory.hicache.storage import StorageWriter

    gate = threading.Event()
    real_set, real_flush = FileStorage.set, StorageWriter.flush

    def held_set(self, key, data):
        gate.wait()
        return real_set(self, key, data)

    def releasing_flush(self):
        gate.set()
        real_flush(self)

    monkeypatch.setattr(FileStorage, "set", held_set)
    monkeypatch.setattr(StorageWriter, "flush", releasing_flush)
    try:
        pool, allocator, cache = _make("write_through", storage_dir=tmp_path)
        tokens = list(range(10, 26))
        cache.insert(tokens, _compute(pool, allocator, tokens), NS)
        queued = cache.storage.blocks_submitted
        assert queued > 0 and not list(tmp_path.rglob("*.kv"))   # all still queued
        cache.reset()
        assert len(list(tmp_path.rglob("*.kv"))) == queued
    finally:
        gate.set()   # never leave the writer thread blocked
