"""Which data-parallel replica a request goes to (``--load-balance-method``).

SGLang's names: ``round_robin``, ``total_requests`` (fewest requests in flight; older SGLang
called it ``shortest_queue``, accepted too), ``total_tokens`` (fewest prompt + budget tokens in
flight; ``minimum_tokens``) and ``auto`` (= round robin, as SGLang without PD). Ours:
``cache_aware``, the sglang-router's policy name: send a request to the replica most likely
to hold its prefix, unless the replicas are imbalanced.

    prompt  [t0 ... t15 | t16 ... t31 | t32 ...]      blocks of BLOCK_TOKENS tokens
    keys    h(b0)       h(b0,b1)      h(b0,b1,b2)     chained: a key names a whole prefix
    table   key -> replicas that recently computed that prefix (LRU, MAX_KEYS keys)

A request's match on a replica is how many leading blocks' keys list it. Like the router:
when the loads differ by more than ``balance_abs_threshold`` requests *and* by a factor of
``balance_rel_threshold``, the least loaded replica wins; otherwise the best match wins if it
covers at least ``cache_threshold`` of the prompt, else the least loaded. The table is a
frontend-side guess (a replica may have evicted the prefix), so it only steers, never
affects correctness.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BLOCK_TOKENS", "LOAD_BALANCE_METHODS", "CacheAware", "Dispatcher", "Load",
           "RoundRobin", "ShortestQueue", "create_dispatcher"]

LOAD_BALANCE_METHODS = ("auto", "round_robin", "total_requests", "shortest_queue",
                        "total_tokens", "minimum_tokens", "cache_aware")
BLOCK_TOKENS = 16
MAX_KEYS = 1 << 16


@dataclass
class Load:
    """What one replica has in flight (kept by the DP host as requests come and go)."""

    requests: int = 0
    tokens: int = 0


class Dispatcher(ABC):
    """Picks a replica for each request; `record` tells it where a request went."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    @abstractmethod
    def pick(self, input_ids: Sequence[int], loads: Sequence[Load]) -> int:
        """The replica index for a request with this prompt, given the replicas' loads.
        Changes nothing (the caller calls `record` once the request is sent)."""

    def record(self, input_ids: Sequence[int], replica: int) -> None:
        """The request went to `replica` (a policy that learns from placements updates
        here). Default: nothing to learn."""
        return None


class RoundRobin(Dispatcher):
    """Replicas in turn, whatever they hold."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.next = 0

    def pick(self, input_ids: Sequence[int], loads: Sequence[Load]) -> int:
        return self.next

    def record(self, input_ids: Sequence[int], replica: int) -> None:
        self.next = (replica + 1) % self.num_replicas


class ShortestQueue(Dispatcher):
    """The replica with the fewest requests (or tokens) in flight; ties to the lowest index."""

    def __init__(self, num_replicas: int, by_tokens: bool = False) -> None:
        super().__init__(num_replicas)
        self.by_tokens = by_tokens

    def pick(self, input_ids: Sequence[int], loads: Sequence[Load]) -> int:
        key = (lambda i: (loads[i].tokens, loads[i].requests)) if self.by_tokens else \
            (lambda i: (loads[i].requests, loads[i].tokens))
        return min(range(self.num_replicas), key=key)


def prefix_keys(input_ids: Sequence[int]) -> list[bytes]:
    """One chained key per whole block of the prompt (a key stands for the prefix up to its
    block's end, so equal keys mean equal prefixes)."""
    keys, digest = [], b""
    for end in range(BLOCK_TOKENS, len(input_ids) + 1, BLOCK_TOKENS):
        block = ",".join(map(str, input_ids[end - BLOCK_TOKENS:end])).encode()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        keys.append(digest)
    return keys


class CacheAware(Dispatcher):
    """Prefix affinity with a load guard (the sglang-router's cache_aware, in miniature)."""

    def __init__(self, num_replicas: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5) -> None:
        super().__init__(num_replicas)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.table: OrderedDict[bytes, set[int]] = OrderedDict()
        self.fallback = ShortestQueue(num_replicas)

    def _imbalanced(self, loads: Sequence[Load]) -> bool:
        most = max(x.requests for x in loads)
        least = min(x.requests for x in loads)
        return (most - least > self.balance_abs_threshold
                and most > self.balance_rel_threshold * least)

    def matched_blocks(self, input_ids: Sequence[int]) -> list[int]:
        """Per replica, how many leading blocks of the prompt it is believed to hold."""
        matched = [0] * self.num_replicas
        alive = set(range(self.num_replicas))
        for depth, key in enumerate(prefix_keys(input_ids), start=1):
            alive &= self.table.get(key, set())
            if not alive:
                break
            for r in alive:
                matched[r] = depth
        return matched

    def pick(self, input_ids: Sequence[int], loads: Sequence[Load]) -> int:
        if self._imbalanced(loads):
            return self.fallback.pick(input_ids, loads)
        matched = self.matched_blocks(input_ids)
        best = max(range(self.num_replicas), key=lambda r: (matched[r], -loads[r].requests))
        if matched[best] * BLOCK_TOKENS >= self.cache_threshold * len(input_ids) > 0:
            return best
        return self.fallback.pick(input_ids, loads)

    def record(self, input_ids: Sequence[int], replica: int) -> None:
        for key in prefix_keys(input_ids):
            holders = self.table.pop(key, set())
            holders.add(replica)
            self.table[key] = holders      # most recent last
        while len(self.table) > MAX_KEYS:
            self.table.popitem(last=False)


def create_dispatcher(method: str, num_replicas: int) -> Dispatcher:
    """The dispatcher for a ``load_balance_method`` value (ValueError naming the field)."""
    if method in ("auto", "round_robin"):
        return RoundRobin(num_replicas)
    if method in ("total_requests", "shortest_queue"):
        return ShortestQueue(num_replicas)
    if method in ("total_tokens", "minimum_tokens"):
        return ShortestQueue(num_replicas, by_tokens=True)
    if method == "cache_aware":
        return CacheAware(num_replicas)
    raise ValueError(f"load_balance_method: must be one of {list(LOAD_BALANCE_METHODS)}, "
                     f"got {method!r}")
