"""HiRadixCache: the radix tree over three tiers, device pool (L1), host memory (L2), storage (L3).

Each node knows where its KV is: ``value`` (device slots, or None once evicted from the device)
and ``host_value`` (host slots, or None). Two closures keep every path loadable::

    ns root
     +- A  value, host          device nodes are closed under ancestors: the device part of a
         +- B  value, host        path is its prefix, so a match is "device prefix + host rest"
             +- C  -, host      host-held nodes are closed under ancestors too: a backup copies
                 +- D  -, host    unbacked ancestors first, host eviction takes host-only leaves

Device eviction takes unlocked device leaves (no child on the device): a node with a host copy
keeps its place in the tree (value None), one without is removed (``write_back`` copies it to
the host first). ``load_back`` (at admission) gives a match's host-only nodes fresh device
slots, after fetching the blocks that follow from storage (``tiers.StorageTier``), so the
prefill starts from the whole hit; the copies of all of a step's admissions are queued and done
in bulk by ``commit_loads`` before the forward (``transfers.py``). Write policies, as SGLang's:
``write_through`` backs a node up when it is inserted, ``write_through_selective`` once an
admitted request matches it a second time (its hit count reaches 2), ``write_back`` only when
the device evicts it. The helpers reach the tree through its public surface (``node.HostTree``)
or what ``check_integrity`` hands them (``integrity.TreeBook``), never its private state.

Namespaces (weight generation + extra key) partition every tier: a retired generation's nodes
are dropped with their host copies, and storage keys hash the weights' fingerprint.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Optional

import torch

from rollout_engine.memory.hicache import transfers
from rollout_engine.memory.hicache.host_pool import HostKVPool
from rollout_engine.memory.hicache.integrity import TreeBook, check_hiradix
from rollout_engine.memory.hicache.node import HiTreeNode, cat_slots, device_prefix
from rollout_engine.memory.hicache.stats import HiCacheStats
from rollout_engine.memory.hicache.tiers import StorageTier
from rollout_engine.memory.prefix_cache import CacheNamespace, MatchResult, empty_slots
from rollout_engine.memory.radix_cache import RadixCache
from rollout_engine.memory.radix_node import TreeNode, child_key, held_len, iter_nodes, page_aligned

__all__ = ["HiRadixCache", "HiTreeNode", "WRITE_POLICIES"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiRadixCache(RadixCache):
    """Radix cache whose evicted pages live on in host memory (and storage, if given)."""

    node_cls = HiTreeNode

    def __init__(self, allocator: object, host: HostKVPool, write_policy: str = "write_through",
                 storage: Optional[StorageTier] = None, page_size: int = 1,
                 flush_storage: bool = False) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, "
                             f"got {write_policy!r}")
        super().__init__(allocator, page_size)
        self.root = HiTreeNode((), empty_slots(), None)
        self.host = host
        self.write_policy = write_policy
        self.storage = storage
        self.flush_storage_on_reset = flush_storage   # reset also deletes our L3 blocks
        self.stats = HiCacheStats()
        self._pinned: set[int] = set()     # host-only nodes a load in progress must keep
        self._loads = transfers.PendingLoads()   # this step's host -> device copies

    # ---- matching ---------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], namespace: CacheNamespace) -> MatchResult:
        """The device-resident part of the longest match (host hits are loaded by
        ``load_back``, which only admission calls)."""
        key = page_aligned(token_ids, self.page_size)
        ns_root = self.root.children.get(namespace)
        if ns_root is None or not key:
            return MatchResult(empty_slots(), ns_root if ns_root is not None else self.root)
        path, _ = self._walk_path(ns_root, key)
        device = device_prefix(path)
        node = device[-1] if device else ns_root
        if device and self._is_evictable_leaf(node):
            self._push_leaf(node)
        return MatchResult(cat_slots([n.value for n in device]), node)

    def load_back(self, token_ids: Sequence[int], namespace: CacheNamespace,
                  rid: Optional[str] = None) -> MatchResult:
        """The longest match over every tier, made device-resident: host-only nodes (and the
        blocks storage holds after them) get fresh device slots, as far as the device pool has
        room, their copy queued (``commit_loads``). Counts a hit on every device node
        (selective write-through). With ``rid`` storage is never waited for: blocks not read
        yet leave ``rid`` pending (``prefetch_pending``) and are not part of this match."""
        key = page_aligned(token_ids, self.page_size)
        if not key:
            return self.match_prefix(token_ids, namespace)
        ns_root = self.root.children.get(namespace)
        if ns_root is None:
            if self.storage is None:
                return MatchResult(empty_slots(), self.root)
            ns_root = self.node_cls((), empty_slots(), self.root)
            self.root.children[namespace] = ns_root
        path, pos = self._walk_path(ns_root, key)
        self._pinned = {id(n) for n in path}   # host eviction keeps this path meanwhile
        try:
            device = device_prefix(path)
            hosts = path[len(device):]
            for hit in device:
                self._count_hit(hit)
            fetched = None
            if self.storage is not None and pos < len(key):
                fetched = self.storage.fetch_after(self, namespace, path[-1] if path else ns_root,
                                                   key, pos, rid)
                if fetched is not None:
                    hosts.append(fetched)
                    self._pinned.add(id(fetched))
                    if ns_root.parent is None:   # host eviction emptied and dropped it meanwhile
                        ns_root.parent = self.root
                        self.root.children[namespace] = ns_root
            loaded = transfers.load(self, device, hosts) if hosts else []
        finally:
            self._pinned = set()
        self._drop_namespace_if_empty(ns_root)
        nodes = device + loaded
        node: TreeNode = nodes[-1] if nodes else (
            ns_root if ns_root.parent is not None else self.root)
        if nodes and self._is_evictable_leaf(node):
            self._push_leaf(node)
        from_storage = len(fetched.key) if fetched is not None and fetched in loaded else 0
        return MatchResult(cat_slots([n.value for n in nodes]), node,
                           host_hit_len=sum(len(n.key) for n in loaded) - from_storage,
                           storage_hit_len=from_storage)

    def prefetch(self, rid: str, token_ids: Sequence[int], namespace: CacheNamespace) -> None:
        """Request ``rid`` arrived: start reading the storage blocks after what the tree holds
        for it (read-only walk: nothing is touched or split)."""
        if self.storage is not None:
            key = page_aligned(token_ids, self.page_size)
            held = held_len(self.root.children.get(namespace), key, self.page_size)
            self.storage.prefetch(rid, namespace, key, held)

    def prefetch_pending(self, rid: str) -> bool:
        return self.storage is not None and self.storage.prefetch_pending(rid)

    def wait_prefetch(self, timeout: float) -> None:
        if self.storage is not None:
            self.storage.wait_prefetch(timeout)

    def forget_prefetch(self, rid: str) -> None:
        if self.storage is not None:
            self.storage.forget_prefetch(rid)

    def queue_load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self._loads.add(host_slots, device_slots)

    def commit_loads(self) -> None:
        """Copy every load queued since the last commit, in bulk (before any forward)."""
        self._loads.commit(self.host, self.stats)

    def on_admit(self, match: MatchResult) -> None:
        self.stats.device_hit_tokens += (match.matched_len - match.host_hit_len
                                         - match.storage_hit_len)
        self.stats.host_hit_tokens += match.host_hit_len
        self.stats.storage_hit_tokens += match.storage_hit_len

    # ---- insertion ----------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor,
               namespace: CacheNamespace) -> int:
        """As RadixCache.insert; host-only nodes on the path take the caller's fresh slots
        (their KV was just recomputed), so P is the device prefix before them."""
        begun = self._insert_start(token_ids, slots, namespace)
        if begun is None:
            return 0
        key, ns_root = begun
        path, pos = self._walk_path(ns_root, key)
        device = device_prefix(path)
        present = sum(len(n.key) for n in device)
        start = present
        for node in path[len(device):]:
            node.value = slots[start:start + len(node.key)].to(torch.int64).clone()
            self._evictable_size += len(node.key)
            start += len(node.key)
            self.version += 1
        last = path[-1] if path else ns_root
        if pos < len(key):
            leaf = HiTreeNode(key[pos:], slots[pos:len(key)].to(torch.int64).clone(), last)
            leaf.last_access = next(self._clock)
            leaf.hit_count = 1
            last.children[child_key(leaf.key, self.page_size)] = leaf
            self._num_nodes += 1
            self._evictable_size += len(leaf.key)
            self.version += 1
            if self.write_policy == "write_through":
                self.backup(leaf)
            last = leaf
        if self._is_evictable_leaf(last):
            self._push_leaf(last)
        return present

    # ---- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free device slots of LRU device leaves; backed-up nodes stay in the tree host-only."""
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and self._leaf_heap:
            access, _, node = heapq.heappop(self._leaf_heap)
            if not self._is_evictable_leaf(node) or access != node.last_access:
                continue
            assert isinstance(node, HiTreeNode) and node.parent is not None
            parent = node.parent
            if node.host_value is None and self.write_policy == "write_back":
                self.backup(node)
            if node.host_value is not None:
                freed.append(node.value)
                node.value = None  # type: ignore[assignment]
                self._evictable_size -= len(node.key)
                num_freed += len(node.key)
            else:   # unbacked: no host-only child can hang below it (host closure)
                num_freed += self._detach(node, freed)
            if parent.key:
                if self._is_evictable_leaf(parent):
                    self._push_leaf(parent)
            else:
                self._drop_namespace_if_empty(parent)
        self._free(freed)
        return num_freed

    def dec_lock_ref(self, node: object) -> None:
        path = self._path_to_root(node)
        super().dec_lock_ref(node)
        for n in path:   # a device leaf may have host-only children: RadixCache skips it
            if n.parent is not None and self._is_evictable_leaf(n):
                self._push_leaf(n)

    def retire_generations_before(self, generation: int) -> int:
        freed = super().retire_generations_before(generation)
        if self.storage is not None:
            self.storage.forget_before(generation)
        return freed

    def reset(self) -> None:
        self._loads = transfers.PendingLoads()   # their slots are freed unread
        super().reset()
        self.host.allocator.reset()
        if self.storage is not None:
            self.storage.reset(delete_own=self.flush_storage_on_reset)

    # ---- sizes, memory, integrity -------------------------------------------------------------

    def cached_slots(self) -> torch.Tensor:
        return cat_slots([n.value for n in iter_nodes(self.root) if n.key and n.value is not None])

    def host_slots(self) -> torch.Tensor:
        return cat_slots([getattr(n, "host_value", None) for n in iter_nodes(self.root) if n.key])

    def host_size(self) -> int:
        return self.host.num_slots - self.host.allocator.available_size()

    def kv_buffers(self) -> list[HostKVPool]:
        return [self.host]

    def tier_stats(self) -> dict[str, float]:
        report = self.stats.as_dict()
        report.update(host_cached_tokens=self.host_size(), host_total_tokens=self.host.num_slots,
                      host_pool_bytes=self.host.nbytes())
        if self.storage is not None:
            report.update(self.storage.stats())
        return report

    def flush_storage(self) -> None:
        if self.storage is not None:
            self.storage.flush()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def check_integrity(self) -> None:
        nodes = list(iter_nodes(self.root))
        check_hiradix(TreeBook(
            root=self.root, nodes=nodes, retired=self._retired(),
            num_nodes=self._num_nodes, evictable_size=self._evictable_size,
            protected_size=self._protected_size, page_size=self.page_size,
            in_heap={id(n) for t, _, n in self._leaf_heap if t == n.last_access},
            evictable_leaves=[n for n in nodes if self._is_evictable_leaf(n)],
            device_slots=self.cached_slots(), host_slots=self.host_slots(),
            host_allocator=self.host.allocator))

    # ---- the surface of the tier helpers (node.HostTree) ----------------------------------------

    def backup(self, node: HiTreeNode) -> bool:
        """Copy ``node`` (and its unbacked ancestors first) to the host tier, queueing the whole
        storage blocks each one completes. False if the host tier ran out of room (the
        ancestors copied so far stay backed up)."""
        for n in transfers.unbacked_chain(node):
            if not transfers.backup_one(self, n):
                return False
            if self.storage is not None:
                self.storage.write_node(self, n)
        return True

    def alloc_host(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Host slots for ``num_tokens`` (whole pages), evicting host-only leaves if short;
        None if the host tier cannot hold them. The caller gives them to a node."""
        return transfers.alloc_host(self, num_tokens)

    def attach_device_slots(self, nodes: list[HiTreeNode], slots: torch.Tensor) -> None:
        """Give the host-only ``nodes`` (consecutive on one path, right below its device
        prefix) the device ``slots``, one per token in order, and count them evictable. Their
        KV is valid once the copy the caller queues (``queue_load``) is committed."""
        start = 0
        for node in nodes:
            node.value = slots[start:start + len(node.key)]
            start += len(node.key)
        self._evictable_size += start
        self.version += 1

    def host_leaves(self) -> list[HiTreeNode]:
        """Every node ``is_host_leaf`` holds for (what host eviction may take)."""
        return [n for n in iter_nodes(self.root) if self.is_host_leaf(n)]  # type: ignore[misc]

    def is_host_leaf(self, node: TreeNode) -> bool:
        """Whether ``node`` is host-only, childless and not part of a load in progress."""
        return (bool(node.key) and node.parent is not None and node.value is None
                and not node.children and id(node) not in self._pinned)

    def drop_host_leaf(self, node: HiTreeNode) -> None:
        """Unlink ``node`` (``is_host_leaf``) and free its host slots; its namespace goes too
        if this empties it. The caller bumps ``version``."""
        parent = node.parent
        assert parent is not None and self.is_host_leaf(node)
        self._detach(node, [])
        if not parent.key:
            self._drop_namespace_if_empty(parent)

    # ---- internals ----------------------------------------------------------------------------

    def _count_hit(self, node: HiTreeNode) -> None:
        node.hit_count += 1
        if (self.write_policy == "write_through_selective" and node.hit_count >= 2
                and node.host_value is None):
            self.backup(node)

    def attach_host_node(self, parent: TreeNode, key: tuple[int, ...],
                         host_slots: torch.Tensor) -> HiTreeNode:
        """A new host-only child of ``parent`` (what a storage fetch produces)."""
        node = HiTreeNode(key, None, parent)
        node.host_value = host_slots
        node.last_access = next(self._clock)
        parent.children[child_key(key, self.page_size)] = node
        self._num_nodes += 1
        self.version += 1
        return node

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (bool(node.key) and node.parent is not None and node.value is not None
                and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def _free(self, freed: list[torch.Tensor]) -> None:
        if self._loads and freed and self._loads.overlaps(torch.cat(freed)):
            self.commit_loads()   # a queued copy must land before its slots change hands
        super()._free(freed)

    def _detach(self, node: TreeNode, freed: list[torch.Tensor]) -> int:
        """Unlink an unlocked childless node; its host slots are freed now, its device slots
        go to ``freed``. Returns device tokens freed."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[child_key(node.key, self.page_size)]
        node.parent = None
        self._num_nodes -= 1
        host_value = getattr(node, "host_value", None)
        if host_value is not None:
            self.host.allocator.free(host_value)
            node.host_value = None  # type: ignore[attr-defined]
        if node.value is None:
            return 0
        freed.append(node.value)
        self._evictable_size -= len(node.key)
        return len(node.key)
