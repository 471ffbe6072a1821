"""The radix tree's node, and how token keys compare a page at a time.

Keys are compared in whole pages; a node's children are keyed by their first page::

    page_size 4:   node key  (5 6 7 8 | 9 3 1 4)       its child key: (5, 6, 7, 8)
                   match     (5 6 7 8 | 9 3 2 2)       common_len = 4 (the second page differs)
    page_size 1:   children are keyed by their first token (an int)

The functions here only read keys and nodes; nothing in this module changes the tree (a node's
`cut` changes that node only).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Optional

import torch

__all__ = ["TreeNode", "child_key", "common_len", "held_len", "iter_nodes", "page_aligned"]


class TreeNode:
    """One edge of the tree: `key` tokens and their `value` slots."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "num_own_locks", "last_access")

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, parent: Optional[TreeNode]):
        self.key = key
        self.value = value
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0  # locks taken on this node or any descendant
        self.num_own_locks = 0  # locks taken on this node itself
        self.last_access = 0

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access})"

    def cut(self, split_len: int) -> TreeNode:
        """Cut this node's first `split_len` tokens off into a new node, which takes this
        node's parent, lock count and access time; this node keeps the rest of its key and
        slots (and its identity, which lock holders keep). The caller links the new node in
        between the parent and this one."""
        upper = TreeNode(self.key[:split_len], self.value[:split_len], self.parent)
        upper.lock_ref = self.lock_ref
        upper.last_access = self.last_access
        self.key = self.key[split_len:]
        self.value = self.value[split_len:]
        return upper


def page_aligned(token_ids: Sequence[int], page_size: int) -> tuple[int, ...]:
    """`token_ids` cut down to whole pages, as a tuple (a tensor is read as a list first)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    n = len(token_ids) - len(token_ids) % page_size
    return tuple(token_ids[:n])


def child_key(key: tuple[int, ...], page_size: int, start: int = 0) -> Hashable:
    """The key, in its parent's `children`, of a node whose key is `key[start:]`."""
    if page_size == 1:
        return key[start]
    return key[start : start + page_size]


def common_len(node_key: tuple[int, ...], key: tuple[int, ...], start: int,
               page_size: int) -> int:
    """Tokens shared by node_key and key[start:], rounded down to whole pages."""
    if key[start : start + len(node_key)] == node_key:
        return len(node_key)
    ps = page_size
    n = min(len(node_key), len(key) - start)
    if ps == 1:
        for i in range(n):
            if node_key[i] != key[start + i]:
                return i
        return n
    for i in range(0, n - n % ps, ps):
        if node_key[i : i + ps] != key[start + i : start + i + ps]:
            return i
    return n - n % ps


def iter_nodes(root: TreeNode) -> Iterator[TreeNode]:
    """Every node under `root`, `root` first, depth first."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def held_len(ns_root: Optional[TreeNode], key: tuple[int, ...], page_size: int) -> int:
    """Tokens of `key` the tree under `ns_root` holds, found without touching (access times)
    or splitting anything; 0 when `ns_root` is None."""
    node = ns_root
    pos = 0
    while node is not None and pos < len(key):
        child = node.children.get(child_key(key, page_size, pos))
        if child is None:
            break
        common = common_len(child.key, key, pos, page_size)
        pos += common
        node = child if common == len(child.key) else None
    return pos
