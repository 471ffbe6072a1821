"""The hierarchical cache's tree node, and the surface of the cache its tier helpers use.

``HiTreeNode`` is a radix node with a host copy: ``value`` (device slots, None once evicted from
the device) and ``host_value`` (host slots, or None); a split cuts both. ``HostTree`` is the part of
``HiRadixCache`` that ``transfers`` and ``tiers`` call, as a protocol: the helpers reach the
cache through these methods only, and never import the cache's module.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from rollout_engine.memory.hicache.host_pool import HostKVPool
from rollout_engine.memory.hicache.stats import HiCacheStats
from rollout_engine.memory.prefix_cache import empty_slots
from rollout_engine.memory.radix_node import TreeNode

__all__ = ["HiTreeNode", "HostTree", "cat_slots", "device_prefix"]


class HiTreeNode(TreeNode):
    """A tree node with a host copy and a hit count (``value`` None: not on the device)."""

    __slots__ = ("host_value", "hit_count")

    def __init__(self, key: tuple[int, ...], value: Optional[torch.Tensor],
                 parent: Optional[TreeNode]) -> None:
        super().__init__(key, value, parent)  # type: ignore[arg-type]
        self.host_value: Optional[torch.Tensor] = None
        self.hit_count = 0

    def cut(self, split_len: int) -> HiTreeNode:
        """As TreeNode.cut, for both tiers' slots; the new node keeps this one's hit count."""
        upper = HiTreeNode(self.key[:split_len],
                           None if self.value is None else self.value[:split_len], self.parent)
        if self.host_value is not None:
            upper.host_value = self.host_value[:split_len]
            self.host_value = self.host_value[split_len:]
        upper.hit_count = self.hit_count
        upper.lock_ref = self.lock_ref
        upper.last_access = self.last_access
        self.key = self.key[split_len:]
        self.value = None if self.value is None else self.value[split_len:]
        return upper


def device_prefix(path: list[HiTreeNode]) -> list[HiTreeNode]:
    """The leading nodes of ``path`` that hold device slots."""
    out = []
    for node in path:
        if node.value is None:
            break
        out.append(node)
    return out


def cat_slots(values: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """The slot tensors of ``values`` (None and empty ones skipped) as one int64 tensor."""
    kept = [v for v in values if v is not None and v.numel()]
    return torch.cat(kept) if kept else empty_slots()


class HostTree(Protocol):
    """What the tier helpers use of ``HiRadixCache`` (each method's contract is there)."""

    page_size: int
    allocator: Any          # the device pool's page allocator
    host: HostKVPool
    stats: HiCacheStats
    root: TreeNode
    version: int

    def inc_lock_ref(self, node: object) -> None: ...

    def dec_lock_ref(self, node: object) -> None: ...

    def evict(self, num_tokens: int) -> int: ...

    def queue_load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None: ...

    def backup(self, node: HiTreeNode) -> bool: ...

    def alloc_host(self, num_tokens: int) -> Optional[torch.Tensor]: ...

    def attach_host_node(self, parent: TreeNode, key: tuple[int, ...],
                         host_slots: torch.Tensor) -> HiTreeNode: ...

    def attach_device_slots(self, nodes: list[HiTreeNode], slots: torch.Tensor) -> None: ...

    def host_leaves(self) -> list[HiTreeNode]: ...

    def is_host_leaf(self, node: TreeNode) -> bool: ...

    def drop_host_leaf(self, node: HiTreeNode) -> None: ...
