"""RadixCache: a radix tree over token ids whose values are KV slot indices.

Tree shape (page_size 1)::

    root
     +- ns(gen 1)                   one namespace root per CacheNamespace: a match never
     |   +- [5 6 7] -> slots          crosses weight generations or extra keys
     |   |   +- [8 9]               children keyed by their first page of tokens
     |   |   +- [3]
     |   +- [2 2]
     +- ns(gen 0, "lora-a")         retired after a refit: holds only what running requests
         +- ...                       still lock, freed as each lock drops

Every non-root node holds a non-empty key whose length is a multiple of page_size and one slot per
token. A node's lock_ref counts the locks taken on it or on any descendant, so a locked node's
ancestors are locked too and only unlocked leaves are ever evicted. Handles returned by
`match_prefix` stay valid across splits: a split inserts the new node *above* the old one.
The node and the page-wise key arithmetic are in radix_node.py; the invariants, as code, in
radix_integrity.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from rollout_engine.memory.prefix_cache import (
    BasePrefixCache,
    CacheNamespace,
    MatchResult,
    empty_slots,
)
from rollout_engine.memory.radix_integrity import RadixBook, check_radix
from rollout_engine.memory.radix_node import (
    TreeNode,
    child_key,
    common_len,
    iter_nodes,
    page_aligned,
)

__all__ = ["RadixCache"]


class RadixCache(BasePrefixCache):
    """Prefix cache over token ids, LRU eviction of unlocked leaves, one subtree per namespace.

    `allocator` needs only `free(slots: torch.Tensor)`; every call passes whole pages.
    """

    node_cls: type[TreeNode] = TreeNode   # the class of the nodes this tree makes

    def __init__(self, allocator: object, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode((), empty_slots(), None)
        self._clock = itertools.count(1)  # logical time: deterministic LRU
        self._seq = itertools.count()  # heap tie-breaker
        # Lazy min-heap of (last_access, seq, leaf); stale entries are skipped when popped.
        self._leaf_heap: list[tuple[int, int, TreeNode]] = []
        self._num_nodes = 0  # token-holding nodes
        self._evictable_size = 0
        self._protected_size = 0
        self._live_generation: Optional[int] = None  # namespaces of older ones are retired
        self.version = 0  # bumped by every change a match could see (callers cache matches)

    # ---- queries --------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], namespace: CacheNamespace) -> MatchResult:
        key = page_aligned(token_ids, self.page_size)
        ns_root = self.root.children.get(namespace)
        if ns_root is None or not key:
            return MatchResult(
                slots=empty_slots(), node=ns_root if ns_root is not None else self.root
            )
        node, _, values = self._walk(ns_root, key)
        if node is not ns_root and not node.children:
            self._push_leaf(node)
        slots = torch.cat(values) if values else empty_slots()
        return MatchResult(slots=slots, node=node)

    def insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, namespace: CacheNamespace
    ) -> int:
        start = self._insert_start(token_ids, slots, namespace)
        if start is None:
            return 0
        key, ns_root = start
        node, prefix_len, _ = self._walk(ns_root, key)
        if prefix_len < len(key):
            leaf = TreeNode(
                key[prefix_len:], slots[prefix_len : len(key)].to(torch.int64).clone(), node
            )
            leaf.last_access = next(self._clock)
            node.children[child_key(leaf.key, self.page_size)] = leaf
            self._num_nodes += 1
            self._evictable_size += len(leaf.key)
            self._push_leaf(leaf)
            self.version += 1
        elif node is not ns_root and not node.children:
            self._push_leaf(node)
        return prefix_len

    # ---- locks ----------------------------------------------------------------------------

    def inc_lock_ref(self, node: object) -> None:
        path = self._path_to_root(node)
        path[0].num_own_locks += 1
        for n in path:
            if n.lock_ref == 0:
                self._evictable_size -= len(n.key)
                self._protected_size += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: object) -> None:
        path = self._path_to_root(node)
        if path[0].num_own_locks <= 0 or any(n.lock_ref <= 0 for n in path):
            raise ValueError(f"dec_lock_ref on {node!r} without a matching inc_lock_ref")
        path[0].num_own_locks -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected_size -= len(n.key)
                self._evictable_size += len(n.key)
                if n.key and not n.children:
                    self._push_leaf(n)
        if len(path) >= 2 and not path[-2].key:
            self._drop_namespace_if_empty(path[-2])
        if self._live_generation is not None:
            self._drop_unlocked(self._retired())

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and self._leaf_heap:
            access, _, node = heapq.heappop(self._leaf_heap)
            if not self._is_evictable_leaf(node) or access != node.last_access:
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            num_freed += self._detach(node, freed)
            if parent.key:
                if not parent.children and parent.lock_ref == 0:
                    self._push_leaf(parent)
            else:
                self._drop_namespace_if_empty(parent)
        self._free(freed)
        return num_freed

    def evict_namespaces_except(self, keep: CacheNamespace) -> int:
        num_freed = self._drop_unlocked([ns for ns in self._namespaces() if ns != keep])
        self._rebuild_heap()
        return num_freed

    def retire_generations_before(self, generation: int) -> int:
        if self._live_generation is None or generation > self._live_generation:
            self._live_generation = generation
        num_freed = self._drop_unlocked(self._retired())
        self._rebuild_heap()
        return num_freed

    def _retired(self) -> list[CacheNamespace]:
        live = self._live_generation
        return [] if live is None else [ns for ns in self._namespaces() if ns.generation < live]

    def _namespaces(self) -> list[CacheNamespace]:
        return [ns for ns in self.root.children if isinstance(ns, CacheNamespace)]

    def _drop_unlocked(self, namespaces: list[CacheNamespace]) -> int:
        """Free every unlocked node of `namespaces`; returns tokens freed. Detached nodes left
        in the LRU heap are skipped when popped (their parent is None)."""
        freed: list[torch.Tensor] = []
        num_freed = 0
        for namespace in namespaces:
            ns_root = self.root.children[namespace]
            # A node with lock_ref 0 has no locked descendant: drop its whole subtree.
            stack = [ns_root]
            while stack:
                node = stack.pop()
                for child in list(node.children.values()):
                    if child.lock_ref == 0:
                        num_freed += self._detach_subtree(child, freed)
                    else:
                        stack.append(child)
            self._drop_namespace_if_empty(ns_root)
        self._free(freed)
        return num_freed

    def reset(self) -> None:
        if self.root.lock_ref > 0:
            raise RuntimeError(
                f"cannot reset the radix cache while {self.root.lock_ref} lock(s) are held "
                f"({self._protected_size} protected tokens); finish or abort running requests first"
            )
        self._free([self.cached_slots()])
        self.root.children.clear()
        self._leaf_heap.clear()
        self._num_nodes = 0
        self._evictable_size = 0
        self._protected_size = 0

    # ---- sizes ----------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def cached_slots(self) -> torch.Tensor:
        values = [n.value for n in iter_nodes(self.root) if n.key]
        return torch.cat(values) if values else empty_slots()

    def check_integrity(self) -> None:
        nodes = list(iter_nodes(self.root))
        check_radix(RadixBook(
            root=self.root, nodes=nodes, retired=self._retired(), num_nodes=self._num_nodes,
            evictable_size=self._evictable_size, protected_size=self._protected_size,
            page_size=self.page_size,
            in_heap={id(n) for t, _, n in self._leaf_heap if t == n.last_access},
            evictable_leaves=[n for n in nodes if self._is_evictable_leaf(n)]))

    # ---- internals ------------------------------------------------------------------------

    def _insert_start(self, token_ids: Sequence[int], slots: torch.Tensor,
                      namespace: CacheNamespace) -> Optional[tuple[tuple[int, ...], TreeNode]]:
        """An insert's page-aligned key and namespace root (made if new; its node class is
        ``node_cls``), or None when no whole page is given. Raises on a slot count mismatch."""
        if slots.dim() != 1 or slots.numel() != len(token_ids):
            raise ValueError(
                f"insert needs one slot per token: got {len(token_ids)} tokens and slots of "
                f"shape {tuple(slots.shape)}"
            )
        key = page_aligned(token_ids, self.page_size)
        if not key:
            return None
        ns_root = self.root.children.get(namespace)
        if ns_root is None:
            ns_root = self.node_cls((), empty_slots(), self.root)
            self.root.children[namespace] = ns_root
        return key, ns_root

    def _walk(
        self, ns_root: TreeNode, key: tuple[int, ...]
    ) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """``_walk_path``, as (deepest matched node, matched length, slots)."""
        path, pos = self._walk_path(ns_root, key)
        return (path[-1] if path else ns_root), pos, [n.value for n in path]

    def _walk_path(self, ns_root: TreeNode, key: tuple[int, ...]) -> tuple[list[Any], int]:
        """Follow `key` from `ns_root`, touching every node on the way and splitting the last one
        if the match ends inside it. Returns (the matched nodes in order, matched length)."""
        now = next(self._clock)
        node, pos = ns_root, 0
        path: list[Any] = []
        while pos < len(key):
            child = node.children.get(child_key(key, self.page_size, pos))
            if child is None:
                break
            common = common_len(child.key, key, pos, self.page_size)
            ends_inside = common < len(child.key)
            if ends_inside:
                child = self._split(child, common)
            child.last_access = now
            path.append(child)
            pos += common
            node = child
            if ends_inside:
                break
        return path, pos

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut `node` after split_len tokens; the new upper part is returned and `node` (whose
        identity lock holders keep) becomes its only child with the rest of the key."""
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        upper = node.cut(split_len)
        parent.children[child_key(upper.key, self.page_size)] = upper
        node.parent = upper
        upper.children[child_key(node.key, self.page_size)] = node
        self._num_nodes += 1
        self.version += 1
        return upper

    def _path_to_root(self, node: object) -> list[TreeNode]:
        if not isinstance(node, TreeNode):
            raise ValueError(f"expected a MatchResult.node of this cache, got {node!r}")
        path = [node]
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        if path[-1] is not self.root:
            raise ValueError(f"{node!r} is not in this cache (evicted, or from another cache)")
        return path

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (
            bool(node.key) and node.parent is not None and not node.children and node.lock_ref == 0
        )

    def _push_leaf(self, node: TreeNode) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._seq), node))
        if len(self._leaf_heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()  # drop stale entries; amortized O(1) per push

    def _rebuild_heap(self) -> None:
        self._leaf_heap = [
            (n.last_access, next(self._seq), n)
            for n in iter_nodes(self.root)
            if self._is_evictable_leaf(n)
        ]
        heapq.heapify(self._leaf_heap)

    def _detach(self, node: TreeNode, freed: list[torch.Tensor]) -> int:
        """Unlink an unlocked leaf; its slots go to `freed`."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[child_key(node.key, self.page_size)]
        node.parent = None
        freed.append(node.value)
        self._num_nodes -= 1
        self._evictable_size -= len(node.key)
        return len(node.key)

    def _detach_subtree(self, top: TreeNode, freed: list[torch.Tensor]) -> int:
        """Unlink an unlocked node and everything below it."""
        num_freed = 0
        stack = [top]
        order: list[TreeNode] = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            num_freed += self._detach(node, freed)
        return num_freed

    def _drop_namespace_if_empty(self, ns_root: TreeNode) -> None:
        if ns_root.parent is self.root and not ns_root.children and ns_root.lock_ref == 0:
            for namespace, candidate in list(self.root.children.items()):
                if candidate is ns_root:
                    del self.root.children[namespace]
            ns_root.parent = None

    def _free(self, freed: list[torch.Tensor]) -> None:
        freed = [v for v in freed if v.numel()]
        if freed:
            self.allocator.free(torch.cat(freed))  # type: ignore[attr-defined]
            self.version += 1
