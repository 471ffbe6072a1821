"""The prefix-cache contract shared by the radix tree and its disabled twin.

A prefix cache maps token-id prefixes to the KV slots that already hold their keys and values, so
a new request can skip prefill for the part of its prompt some earlier request computed. Slots are
indices into the KV pool; the cache never allocates, it only takes ownership of slots handed to
`insert` and returns them to the allocator (`allocator.free`) when it evicts them.

Ownership around `insert(token_ids, slots, ns)` with page_size 4 and 10 tokens::

    token_ids  |t0 t1 t2 t3|t4 t5 t6 t7|t8 t9|
               |<---- P ---->|           |
               |<--------- L ----------->|      L = 8: rounded DOWN to a whole page
    slots[:P]    caller keeps (the tree already held KV for these tokens; free your duplicates)
    slots[P:L]   the tree owns them from now on
    slots[L:]    caller keeps (partial page, never cached)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "BasePrefixCache",
    "CacheIntegrityError",
    "CacheNamespace",
    "MatchResult",
    "NoPrefixCache",
]


class CacheIntegrityError(AssertionError):
    """A prefix-cache invariant is broken (a bug in the cache or in how its caller used it)."""


@dataclass(frozen=True)
class CacheNamespace:
    """KV computed under one weight generation (and an optional extra_key, a salt, and LoRA
    adapter) is only matched by requests of the same namespace.

    `generation` is the engine's weight-generation counter, bumped by every weight change (each
    refit, each partial bucket), never the user's version label: a refit that reuses a label, or
    a relabel that changes no weight, cannot make stale KV match or fresh KV miss. `lora` is
    (adapter name, version), the version a counter bumped by every (re)load of an adapter:
    nothing computed under another adapter, or an older load of the same one, ever matches.
    """

    generation: int
    extra_key: Optional[str] = None
    lora: Optional[tuple[str, int]] = None


@dataclass
class MatchResult:
    """The longest cached prefix of a query.

    `slots` are the KV slots of the matched tokens (int64, length a multiple of page_size); `node`
    is an opaque handle to pass to `inc_lock_ref` / `dec_lock_ref` while those slots are in use.
    """

    slots: torch.Tensor
    node: object
    host_hit_len: int = 0      # of matched_len: loaded back from the host tier (HiCache)
    storage_hit_len: int = 0   # of matched_len: fetched from the storage tier (HiCache)

    @property
    def matched_len(self) -> int:
        return int(self.slots.numel())


def empty_slots() -> torch.Tensor:
    """An empty int64 slot tensor (what a miss returns)."""
    return torch.empty(0, dtype=torch.int64)


class BasePrefixCache(ABC):
    """A cache from token prefixes to KV slots, partitioned by `CacheNamespace`.

    Callers are single-threaded (the scheduler loop); no method is thread-safe.
    """

    page_size: int
    # bumped by every change a match could see: a caller may keep a match while it stays put
    # (a cache that never changes what it matches, like NoPrefixCache, leaves it at 0)
    version: int = 0

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], namespace: CacheNamespace) -> MatchResult:
        """Return the longest cached prefix of `token_ids` in `namespace`, truncated to a multiple
        of page_size (exact token match only).

        Changes: marks the matched path as most recently used; may split a node so the returned
        node covers exactly the match. The returned slots stay valid only while the caller holds
        a lock on the returned node (`inc_lock_ref`); without one, any later `evict` may free them.
        """

    @abstractmethod
    def insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, namespace: CacheNamespace
    ) -> int:
        """Cache `token_ids[:L]`, L = len(token_ids) rounded down to page_size, with `slots` as
        their KV slots (len(slots) == len(token_ids)).

        Returns P, the number of leading tokens that were already cached (P <= L, a multiple of
        page_size). The cache takes ownership of slots[P:L]; the caller keeps slots[:P] and
        slots[L:] and must free those that are its own (not ones it got from `match_prefix`).
        """

    @abstractmethod
    def inc_lock_ref(self, node: object) -> None:
        """Lock `node` (a `MatchResult.node`) and all its ancestors: locked nodes are never
        evicted. The caller must call `dec_lock_ref(node)` exactly once per call."""

    @abstractmethod
    def dec_lock_ref(self, node: object) -> None:
        """Undo one `inc_lock_ref(node)`; raises ValueError if `node` holds no lock. Nodes whose
        lock count drops to zero become evictable."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves (cascading to parents that become unlocked
        leaves) until at least `num_tokens` tokens are freed or nothing is evictable.

        Changes: removes nodes and returns their slots through `allocator.free`. Returns the
        number of tokens freed."""

    @abstractmethod
    def evict_namespaces_except(self, keep: CacheNamespace) -> int:
        """Free every unlocked node of every namespace other than `keep` (stale KV after a weight
        refit). Locked stale nodes stay until unlocked and are evictable after that; `keep`
        requests can never match them. Returns the number of tokens freed."""

    @abstractmethod
    def retire_generations_before(self, generation: int) -> int:
        """Retire every namespace whose generation is older than `generation` (a weight change):
        free its unlocked nodes now, and from then on free each of its nodes as soon as it is
        unlocked, including what a request that started under the old weights inserts when it
        finishes. Retired KV is never matched by current requests and never outlives its last
        user. Returns the number of tokens freed now."""

    @abstractmethod
    def reset(self) -> None:
        """Free every cached slot and empty the cache. Raises RuntimeError if any lock is held
        (check `protected_size()` and drain running requests first)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes (what `evict` could free)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held in locked nodes."""

    @abstractmethod
    def total_size(self) -> int:
        """All tokens held by the cache (evictable + protected)."""

    @abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every slot the cache holds, int64, in no particular order (for the engine-wide
        'free + owned + cached == total' check)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise `CacheIntegrityError` (an AssertionError) naming the broken invariant: sizes,
        lock counts, duplicate slots, malformed nodes or page alignment."""

    # ---- lower tiers (HiCache); a single-tier cache keeps these defaults ----------------------

    def load_back(self, token_ids: Sequence[int], namespace: CacheNamespace,
                  rid: Optional[str] = None) -> MatchResult:
        """`match_prefix`, extended by what lower tiers hold and given device slots, their copy
        queued until `commit_loads` (called once per admission attempt, never by ordering).
        With request `rid`, slow reads are never waited for: they leave `rid` pending
        (`prefetch_pending`). Single tier: just `match_prefix`."""
        return self.match_prefix(token_ids, namespace)

    def commit_loads(self) -> None:
        """Finish the copies `load_back` queued into device slots (one bulk copy per step);
        the scheduler calls it before every forward."""
        return None

    def prefetch(self, rid: str, token_ids: Sequence[int], namespace: CacheNamespace) -> None:
        """Request `rid` for `token_ids` arrived: a cache with a slow tier may start reading
        its part of the prefix in the background (`load_back` decides what is used)."""
        return None

    def prefetch_pending(self, rid: str) -> bool:
        """True while request `rid` should wait aside for its background reads (by the
        cache's prefetch policy) while the requests behind it are admitted; the first False
        ends the cache's tracking of it."""
        return False

    def wait_prefetch(self, timeout: float) -> None:
        """Block until a pending prefetch may have progressed, at most `timeout` seconds
        (the scheduler has nothing else to run)."""
        return None

    def forget_prefetch(self, rid: str) -> None:
        """Request `rid` left the queue without being admitted (aborted)."""
        return None

    def on_admit(self, match: MatchResult) -> None:
        """A request was admitted with `match` (per-tier hit counters)."""
        return None

    def tier_stats(self) -> Optional[dict[str, float]]:
        """Counters of the lower tiers, or None without any."""
        return None

    def kv_buffers(self) -> list:
        """Memory besides the device pool that sleeping with `kv_cache` must free: objects with
        `release()`, `allocate()` and `nbytes()`."""
        return []

    def close(self) -> None:
        """Finish background work (storage writes) before the engine exits."""
        return None


class NoPrefixCache(BasePrefixCache):
    """The disabled cache (`disable_radix_cache`): never matches, never holds a slot.

    `insert` reports every token as already present, so the caller frees all the slots it owns.
    """

    def __init__(self, allocator: object = None, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._handle = object()

    def match_prefix(self, token_ids: Sequence[int], namespace: CacheNamespace) -> MatchResult:
        return MatchResult(slots=empty_slots(), node=self._handle)

    def insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, namespace: CacheNamespace
    ) -> int:
        return len(token_ids)

    def inc_lock_ref(self, node: object) -> None:
        pass

    def dec_lock_ref(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evict_namespaces_except(self, keep: CacheNamespace) -> int:
        return 0

    def retire_generations_before(self, generation: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return empty_slots()

    def check_integrity(self) -> None:
        pass
