"""RadixCache and NoPrefixCache: unit tests plus a hypothesis state machine against a reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace, NoPrefixCache
from rollout_engine.memory.radix_cache import RadixCache

V0 = CacheNamespace("v0")
V1 = CacheNamespace("v1")
V0_LORA = CacheNamespace("v0", extra_key="lora-a")


class FakeAllocator:
    """Hands out page-aligned slots and records what the cache frees (each slot at most once)."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.next_page = 0
        self.freed: set[int] = set()
        self.free_calls: list[list[int]] = []

    def alloc(self, num_tokens: int) -> torch.Tensor:
        num_pages = -(-num_tokens // self.page_size)
        start = self.next_page * self.page_size
        self.next_page += num_pages
        return torch.arange(start, start + num_tokens, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        ps = self.page_size
        assert slots.numel() % ps == 0, "cache freed a partial page"
        pages = slots.view(-1, ps)
        assert (pages[:, 0] % ps == 0).all() and (pages - pages[:, :1] == torch.arange(ps)).all()
        values = slots.tolist()
        assert len(set(values)) == len(values), "duplicate slot in one free call"
        assert not self.freed & set(values), "double free"
        self.freed |= set(values)
        self.free_calls.append(values)


def make(page_size: int = 1) -> tuple[RadixCache, FakeAllocator]:
    alloc = FakeAllocator(page_size)
    return RadixCache(alloc, page_size=page_size), alloc


def insert(cache: RadixCache, alloc: FakeAllocator, tokens: list[int], ns=V0) -> torch.Tensor:
    slots = alloc.alloc(len(tokens))
    cache.insert(tokens, slots, ns)
    cache.check_integrity()
    return slots


# ---- unit tests ----------------------------------------------------------------------------


def test_match_on_empty_cache():
    cache, _ = make()
    result = cache.match_prefix([1, 2, 3], V0)
    assert result.slots.numel() == 0 and result.slots.dtype == torch.int64
    assert cache.total_size() == 0
    cache.inc_lock_ref(result.node)  # locking a miss is allowed and harmless
    cache.dec_lock_ref(result.node)
    cache.check_integrity()


def test_insert_then_match_full_and_partial():
    cache, alloc = make()
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots, V0) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5], V0).slots.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7], V0).slots.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 7], V0).slots.tolist() == slots[:2].tolist()
    assert cache.match_prefix([9, 1, 2], V0).slots.numel() == 0
    # Second insert sharing 3 tokens: P = 3, the tree takes only the new suffix.
    slots2 = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 8, 8, 8], slots2, V0) == 3
    assert cache.total_size() == 8
    expected = slots[:3].tolist() + slots2[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 8, 8, 8], V0).slots.tolist() == expected
    assert sorted(cache.cached_slots().tolist()) == sorted(slots.tolist() + slots2[3:].tolist())
    cache.check_integrity()


def test_split_inside_node_returns_node_covering_exactly_the_match():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3, 4, 5])
    result = cache.match_prefix([1, 2, 3, 9], V0)
    assert result.matched_len == 3
    cache.inc_lock_ref(result.node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.check_integrity()
    assert cache.evict(100) == 2  # only the unlocked tail [4, 5] can go
    assert cache.match_prefix([1, 2, 3, 4, 5], V0).matched_len == 3
    cache.dec_lock_ref(result.node)
    assert cache.evict(100) == 3 and cache.total_size() == 0
    cache.check_integrity()


def test_lock_handle_survives_a_later_split():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3, 4])
    full = cache.match_prefix([1, 2, 3, 4], V0)
    cache.inc_lock_ref(full.node)
    assert cache.match_prefix([1, 2, 9], V0).matched_len == 2  # splits the locked node
    cache.check_integrity()
    assert cache.protected_size() == 4
    cache.dec_lock_ref(full.node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_integrity()


def test_page_size_16_alignment():
    cache, alloc = make(page_size=16)
    tokens = list(range(37))
    slots = alloc.alloc(37)
    assert cache.insert(tokens, slots, V0) == 0
    assert cache.total_size() == 32  # the 5-token partial page stays with the caller
    query = tokens[:35] + [1000, 1001, 1002, 1003, 1004]
    assert len(query) == 40
    result = cache.match_prefix(query, V0)
    assert result.slots.tolist() == slots[:32].tolist()
    # A mismatch inside the second page keeps only the first page.
    assert cache.match_prefix(tokens[:20] + [999] * 20, V0).matched_len == 16
    assert cache.insert(tokens[:15], alloc.alloc(15), V0) == 0  # less than one page: nothing
    cache.check_integrity()
    assert cache.evict(1) == 16  # evicts a whole page at a time
    assert sorted(alloc.freed) == list(range(16, 32))


def test_namespace_isolation():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3], V0)
    assert cache.match_prefix([1, 2, 3], V1).matched_len == 0
    assert cache.match_prefix([1, 2, 3], V0_LORA).matched_len == 0
    assert cache.match_prefix([1, 2, 3], CacheNamespace("v0")).matched_len == 3
    assert cache.insert([1, 2, 3], alloc.alloc(3), V0_LORA) == 0  # not shared across keys
    assert cache.total_size() == 6
    cache.check_integrity()


def test_lock_protects_from_evict_and_underflow_raises():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3], V0).node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 0 and cache.total_size() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(node)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)
    cache.check_integrity()
    assert cache.evict(100) == 3
    with pytest.raises(ValueError):  # the node left the tree
        cache.inc_lock_ref(node)


def test_evicts_least_recently_used_first():
    cache, alloc = make()
    a = insert(cache, alloc, [1, 1])
    b = insert(cache, alloc, [2, 2])
    c = insert(cache, alloc, [3, 3])
    cache.match_prefix([1, 1], V0)  # a becomes the most recent; b is now the oldest
    assert cache.evict(1) == 2
    assert alloc.free_calls[-1] == b.tolist()
    assert cache.evict(1) == 2
    assert alloc.free_calls[-1] == c.tolist()
    assert cache.match_prefix([1, 1], V0).slots.tolist() == a.tolist()


def test_cascading_eviction_frees_parent_after_children():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3])
    insert(cache, alloc, [1, 2, 4])  # splits into [1 2] -> {[3], [4]}
    insert(cache, alloc, [7])
    cache.match_prefix([7], V0)  # [7] is the most recent
    assert cache.evict(3) == 4  # [3], [4], then their parent [1 2] (now an unlocked leaf)
    assert cache.match_prefix([7], V0).matched_len == 1
    assert cache.match_prefix([1, 2], V0).matched_len == 0
    cache.check_integrity()


def test_evict_namespaces_except_keeps_locked_stale_nodes():
    cache, alloc = make()
    insert(cache, alloc, [1, 2, 3], V0)
    insert(cache, alloc, [1, 2, 4], V0)
    insert(cache, alloc, [5, 6], V0_LORA)
    keep = insert(cache, alloc, [1, 2, 3], V1)
    locked = cache.match_prefix([1, 2, 3], V0).node
    cache.inc_lock_ref(locked)
    assert cache.evict_namespaces_except(V1) == 3  # [4] and [5 6]; [1 2 3] in v0 is locked
    cache.check_integrity()
    assert cache.match_prefix([1, 2, 3], V1).slots.tolist() == keep.tolist()
    assert cache.match_prefix([5, 6], V0_LORA).matched_len == 0
    cache.dec_lock_ref(locked)
    assert cache.evict(100) == 6  # the stale v0 path first (older), then the v1 path
    assert cache.total_size() == 0
    cache.check_integrity()


def test_reset_with_lock_raises_then_frees_everything():
    cache, alloc = make()
    s1 = insert(cache, alloc, [1, 2, 3])
    s2 = insert(cache, alloc, [4], V1)
    node = cache.match_prefix([1], V0).node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.freed == set(s1.tolist() + s2.tolist())
    assert cache.total_size() == 0 and cache.cached_slots().numel() == 0
    cache.check_integrity()


def test_check_integrity_catches_corruption():
    cache, alloc = make()
    insert(cache, alloc, [1, 2])
    insert(cache, alloc, [3, 4])
    node = cache.match_prefix([3, 4], V0).node
    node.value = cache.match_prefix([1, 2], V0).slots.clone()  # the same slots twice
    with pytest.raises(CacheIntegrityError, match="slot"):
        cache.check_integrity()
    node.value = torch.tensor([10, 11])
    node.lock_ref = 1
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity()


def test_no_prefix_cache_does_nothing():
    cache = NoPrefixCache(page_size=4)
    slots = torch.arange(10)
    assert cache.insert(list(range(10)), slots, V0) == 10  # caller frees everything it owns
    result = cache.match_prefix(list(range(10)), V0)
    assert result.matched_len == 0
    cache.inc_lock_ref(result.node)
    cache.dec_lock_ref(result.node)
    assert cache.evict(100) == 0 and cache.evict_namespaces_except(V1) == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.cached_slots().numel() == 0
    cache.reset()
    cache.check_integrity()


def test_rejects_bad_arguments():
    cache, _ = make()
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2, 3], torch.arange(2), V0)
    with pytest.raises(ValueError):
        RadixCache(FakeAllocator(), page_size=0)
    with pytest.raises(ValueError):
        cache.inc_lock_ref("not a node")


# ---- stateful property test ----------------------------------------------------------------

NAMESPACES = [V0, V1, V0_LORA]
tokens_st = st.lists(st.integers(0, 2), max_size=14)


class RadixCacheMachine(RuleBasedStateMachine):
    """Reference: per namespace, a dict from each cached page-aligned prefix to its last page's
    slots. The cached set is prefix-closed; a match is the longest cached prefix of the query."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = FakeAllocator(self.page_size)
        self.cache = RadixCache(self.alloc, self.page_size)
        self.ref: dict[CacheNamespace, dict[tuple[int, ...], list[int]]] = {
            ns: {} for ns in NAMESPACES
        }
        self.handed_in: set[int] = set()
        self.released: set[int] = set()  # slots the caller took back after insert
        self.locks: list[tuple[object, CacheNamespace, tuple[int, ...]]] = []
        self.history: list[list[int]] = [[]]

    # -- reference helpers --

    def pages(self, tokens) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[: i + ps]) for i in range(0, len(tokens) - len(tokens) % ps, ps)]

    def ref_match(self, tokens, ns) -> list[int]:
        slots: list[int] = []
        for prefix in self.pages(tokens):
            if prefix not in self.ref[ns]:
                break
            slots += self.ref[ns][prefix]
        return slots

    def locked_prefixes(self) -> set[tuple[CacheNamespace, tuple[int, ...]]]:
        return {(ns, p) for _, ns, path in self.locks for p in self.pages(path)}

    def compose(self, base: int, cut: int, suffix: list[int]) -> list[int]:
        return self.history[base % len(self.history)][:cut] + suffix

    def sync_frees(self, before: set[int]) -> set[tuple[CacheNamespace, tuple[int, ...]]]:
        """Drop from the reference what the cache just freed; return the dropped prefixes."""
        newly = self.alloc.freed - before
        dropped = {(ns, p) for ns, d in self.ref.items() for p, s in d.items() if s[0] in newly}
        assert sum(len(self.ref[ns][p]) for ns, p in dropped) == len(newly)
        for ns, p in dropped:
            del self.ref[ns][p]
        return dropped

    # -- rules --

    @rule(
        base=st.integers(0, 99),
        cut=st.integers(0, 16),
        suffix=tokens_st,
        ns=st.sampled_from(NAMESPACES),
        reuse=st.booleans(),
    )
    def insert(self, base, cut, suffix, ns, reuse):
        tokens = self.compose(base, cut, suffix)
        self.history.append(tokens)
        reused = self.cache.match_prefix(tokens, ns).slots if reuse else torch.empty(0).long()
        if reuse:
            assert reused.tolist() == self.ref_match(tokens, ns)
        fresh = self.alloc.alloc(len(tokens) - len(reused))
        self.handed_in |= set(fresh.tolist())
        slots = torch.cat([reused, fresh])
        expected_prefix = len(self.ref_match(tokens, ns))
        prefix_len = self.cache.insert(tokens, slots, ns)
        assert prefix_len == expected_prefix
        ps = self.page_size
        for i, prefix in enumerate(self.pages(tokens)):
            if i * ps >= prefix_len:
                self.ref[ns][prefix] = slots[i * ps : (i + 1) * ps].tolist()
        cached_len = len(tokens) - len(tokens) % ps
        self.released |= set(slots[len(reused) : prefix_len].tolist())  # own duplicates
        self.released |= set(slots[cached_len:].tolist())  # the partial page

    @rule(
        base=st.integers(0, 99),
        cut=st.integers(0, 16),
        suffix=tokens_st,
        ns=st.sampled_from(NAMESPACES),
        lock=st.booleans(),
    )
    def match(self, base, cut, suffix, ns, lock):
        tokens = self.compose(base, cut, suffix)
        result = self.cache.match_prefix(tokens, ns)
        assert result.slots.tolist() == self.ref_match(tokens, ns)
        if lock:
            self.cache.inc_lock_ref(result.node)
            self.locks.append((result.node, ns, tuple(tokens[: result.matched_len])))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 99))
    def unlock(self, index):
        node, _, _ = self.locks.pop(index % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        before = set(self.alloc.freed)
        num_freed = self.cache.evict(num_tokens)
        dropped = self.sync_frees(before)
        assert num_freed == len(self.alloc.freed) - len(before)
        assert num_freed >= num_tokens or self.cache.evictable_size() == 0
        assert not dropped & self.locked_prefixes(), "evicted a locked prefix"

    @rule(keep=st.sampled_from(NAMESPACES))
    def evict_namespaces_except(self, keep):
        locked = self.locked_prefixes()
        expected = {(ns, p) for ns, d in self.ref.items() if ns != keep for p in d} - locked
        before = set(self.alloc.freed)
        num_freed = self.cache.evict_namespaces_except(keep)
        assert self.sync_frees(before) == expected
        assert num_freed == len(expected) * self.page_size

    # -- invariants --

    @invariant()
    def cache_matches_reference(self):
        self.cache.check_integrity()
        ref_slots = [s for d in self.ref.values() for v in d.values() for s in v]
        cached = self.cache.cached_slots().tolist()
        assert sorted(cached) == sorted(ref_slots)
        assert self.cache.protected_size() == len(self.locked_prefixes()) * self.page_size
        assert self.cache.total_size() == len(cached)
        # Every slot ever handed in is exactly one of: freed by the cache, cached, released.
        freed, cached_set = self.alloc.freed, set(cached)
        assert not (freed & cached_set) and not (freed & self.released)
        assert not (cached_set & self.released)
        assert freed | cached_set | self.released == self.handed_in

    def teardown(self):
        for node, _, _ in self.locks:
            self.cache.dec_lock_ref(node)
        self.cache.reset()
        assert self.alloc.freed | self.released == self.handed_in


class RadixCacheMachinePage4(RadixCacheMachine):
    page_size = 4


_settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheStateful = RadixCacheMachine.TestCase
TestRadixCacheStateful.settings = _settings
TestRadixCacheStatefulPage4 = RadixCacheMachinePage4.TestCase
TestRadixCacheStatefulPage4.settings = _settings
