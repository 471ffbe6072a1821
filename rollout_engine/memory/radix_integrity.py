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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout_engine.memory.prefix_cache import CacheIntegrityError, CacheNamespace, empty_slots
from rollout_engine.memory.radix_node import TreeNode, child_key

__all__ = ["Check", "RadixBook", "check_book", "check_links", "check_pages", "check_radix",
           "checker"]


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


Check = Callable[[bool, str], None]


def checker(cache: str) -> Check:
    """``check(condition, message)``: raise CacheIntegrityError naming ``cache`` if false."""
    def check(condition: bool, message: str) -> None:
        if not condition:
            raise CacheIntegrityError(f"{cache} integrity: {message}")
    return check


def check_links(node: TreeNode, root: TreeNode, ps: int, check: Check) -> None:
    """``node``'s own locks and lock_ref, and its children's back links and keys (the root's
    children are namespace roots: no key, kept only while they hold nodes or locks)."""
    where = f"{node!r} (key[:8]={node.key[:8]})"
    expected_lock = node.num_own_locks + sum(c.lock_ref for c in node.children.values())
    check(node.num_own_locks >= 0, f"{where}: negative own lock count")
    check(node.lock_ref == expected_lock, f"{where}: lock_ref != own locks + children's")
    for key, child in node.children.items():
        check(child.parent is node, f"{where}: child {child!r} has another parent")
        if node is root:
            check(isinstance(key, CacheNamespace), f"root child key {key!r}")
            check(not child.key, f"namespace root {key} has a key")
            check(bool(child.children) or child.lock_ref > 0, f"empty ns {key} kept")
        else:
            check(key == child_key(child.key, ps), f"{where}: child key mismatch")


def check_book(root: TreeNode, retired: list[CacheNamespace], counted: tuple[int, int, int],
               kept: tuple[int, int, int], leaves: list[TreeNode], in_heap: set[int],
               check: Check) -> None:
    """What both caches' bookkeeping must agree on: a retired namespace keeps only locked
    nodes; (nodes, evictable, protected) ``counted`` in the tree equal the ``kept`` counts;
    every evictable leaf has a live LRU heap entry."""
    for namespace in retired:  # retired KV lives only as long as its users
        stack = list(root.children[namespace].children.values())
        while stack:
            node = stack.pop()
            check(node.lock_ref > 0, f"retired namespace {namespace} keeps unlocked {node!r}")
            stack.extend(node.children.values())
    for name, got, want in zip(("node count", "evictable", "protected"), counted, kept):
        check(got == want, f"{name} {want} != {got}")
    for node in leaves:
        check(id(node) in in_heap, f"evictable leaf {node!r} missing from the LRU heap")


def check_pages(slots: torch.Tensor, ps: int, tier: str, check: Check) -> None:
    """No slot held twice; with ``ps > 1``, whole page-aligned pages."""
    check(slots.unique().numel() == slots.numel(), f"a {tier} slot is held twice")
    if ps > 1 and slots.numel():  # every node holds whole pages: so does the concatenation
        pages = slots.view(-1, ps)
        offsets = torch.arange(ps, device=pages.device)
        aligned = (pages[:, 0] % ps == 0).all() and (pages - pages[:, :1] == offsets).all()
        check(bool(aligned), f"{tier} slots are not whole, page-aligned pages")


_check = checker("RadixCache")


def check_radix(book: RadixBook) -> None:
    """Raise CacheIntegrityError naming the first invariant `book` breaks."""
    ps = book.page_size
    evictable = protected = num_nodes = 0
    for node in book.nodes:
        check_links(node, book.root, ps, _check)
        where = f"{node!r} (key[:8]={node.key[:8]})"
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
    check_book(book.root, book.retired, (num_nodes, evictable, protected),
               (book.num_nodes, book.evictable_size, book.protected_size),
               book.evictable_leaves, book.in_heap, _check)
    values = [n.value for n in book.nodes if n.key]
    check_pages(torch.cat(values) if values else empty_slots(), ps, "device", _check)
