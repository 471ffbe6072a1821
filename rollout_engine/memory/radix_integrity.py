"""RadixCache invariants as code (called by `RadixCache.check_integrity`).

Shape: every child points back to its parent and sits under its own child key; the root's
children are namespace roots (no key, no slots), kept only while they hold nodes or locks; every
other node holds whole pages of tokens and one int64 slot per token. Locks: a node's lock_ref is
its own locks plus its children's, so locked nodes are closed under ancestors. Counts: the
node count and the evictable / protected token counts match the tree. Slots: no slot is held
twice, and with page_size > 1 they form whole, page-aligned pages. Eviction: every evictable
leaf has a live LRU heap entry; a retired namespace keeps only locked nodes.

The cache hands its bookkeeping over as a `RadixBook`; nothing here reads its private state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace, empty_slots
from rollout_engine.memory.radix_node import TreeNode, child_key

__all__ = ["RadixBook", "check_radix"]


@dataclass(frozen=True)
class RadixBook:
    """A RadixCache's tree and what its bookkeeping says of it, at one moment."""

    root: TreeNode
    nodes: list[TreeNode]                  # every node, root and namespace roots included
    retired: list[CacheNamespace]          # namespaces of retired weight generations
    num_nodes: int                         # token-holding nodes, as counted
    evictable_size: int                    # tokens of unlocked nodes, as counted
    protected_size: int                    # tokens of locked nodes, as counted
    page_size: int
    in_heap: set[int]                      # ids of the nodes with a live LRU heap entry
    evictable_leaves: list[TreeNode]       # the nodes eviction may take now


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(f"RadixCache integrity: {message}")


def check_radix(book: RadixBook) -> None:
    """Raise CacheIntegrityError naming the first invariant `book` breaks."""
    ps = book.page_size
    evictable = protected = num_nodes = 0
    for node in book.nodes:
        where = f"{node!r} (key[:8]={node.key[:8]})"
        expected_lock = node.num_own_locks + sum(c.lock_ref for c in node.children.values())
        _check(node.num_own_locks >= 0, f"{where}: negative own lock count")
        _check(node.lock_ref == expected_lock, f"{where}: lock_ref != own locks + children's")
        for key, child in node.children.items():
            _check(child.parent is node, f"{where}: child {child!r} has another parent")
            if node is book.root:
                _check(isinstance(key, CacheNamespace), f"root child key {key!r}")
                _check(not child.key, f"namespace root {key} has a key")
                _check(bool(child.children) or child.lock_ref > 0, f"empty ns {key} kept")
            else:
                _check(key == child_key(child.key, ps), f"{where}: child key mismatch")
        if node is book.root or not node.key:
            _check(node.value.numel() == 0, f"{where}: root holds slots")
            continue
        num_nodes += 1
        _check(len(node.key) % ps == 0, f"{where}: key length not a multiple of {ps}")
        _check(node.value.dtype == torch.int64, f"{where}: slots dtype {node.value.dtype}")
        _check(node.value.shape == (len(node.key),), f"{where}: {node.value.shape} slots")
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    for namespace in book.retired:  # retired KV lives only as long as its users
        stack = list(book.root.children[namespace].children.values())
        while stack:
            node = stack.pop()
            _check(node.lock_ref > 0, f"retired namespace {namespace} keeps unlocked {node!r}")
            stack.extend(node.children.values())
    _check(num_nodes == book.num_nodes, f"node count {book.num_nodes} != {num_nodes}")
    _check(evictable == book.evictable_size, f"evictable {book.evictable_size}!={evictable}")
    _check(protected == book.protected_size, f"protected {book.protected_size}!={protected}")
    values = [n.value for n in book.nodes if n.key]
    slots = torch.cat(values) if values else empty_slots()
    _check(slots.unique().numel() == slots.numel(), "a slot is held by two tree positions")
    if ps > 1:  # every node holds whole pages, so the concatenation is page-shaped too
        pages = slots.view(-1, ps)
        offsets = torch.arange(ps, device=pages.device)
        aligned = (pages[:, 0] % ps == 0).all() and (pages - pages[:, :1] == offsets).all()
        _check(bool(aligned), "slots are not whole, page-aligned pages")
    for node in book.evictable_leaves:
        _check(id(node) in book.in_heap, f"evictable leaf {node!r} missing from the LRU heap")
