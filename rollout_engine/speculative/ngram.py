"""N-gram proposals: continue a request from the last place its own tokens repeated.

No second model: the draft for a request is what followed the most recent earlier occurrence of
its current suffix (prompt + output so far). Longer suffixes are tried first (they predict
better); ``min_window..max_window`` are SGLang's ``--speculative-ngram-{min,max}-match-window-size``.

Each request keeps an index ``w-gram -> end position of its latest occurrence`` for every window
size, extended incrementally by the tokens appended since its last proposal, so a proposal costs
``O(max_window)`` dictionary look-ups, not a scan of the sequence::

    ids:   ... a b c x y z ... a b c | ?      suffix "a b c" ends at L = len(ids)
                     ^ end position e of the earlier "a b c": draft = ids[e:e + k]

When the earlier occurrence is close (``e + k > L``) the draft runs into its own tokens: a
sequence that repeats with period ``L - e`` is continued by that period.

``SharedNgramTable`` holds the max-window grams of finished requests (a GRPO prompt's earlier
rounds, a recurring system prompt's answers), bounded to ``SHARED_CAPACITY`` entries, oldest out
first: one gram per token keeps publishing cheap (~1 dict insert a token). A request whose
suffix is found there drafts from it (a max-window match ties or beats its own; a finished
sequence has already gone past the point this one is at).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

__all__ = ["NgramIndex", "NgramProposer", "SharedNgramTable"]

SHARED_CAPACITY = 1 << 15


class SharedNgramTable:
    """``window``-gram -> (the finished sequence it occurred in, its end position); the most
    recently published occurrence wins."""

    def __init__(self, window: int, capacity: int = SHARED_CAPACITY) -> None:
        self.window = window
        self.capacity = capacity
        self.table: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()

    def publish(self, ids: list[int]) -> None:
        """Record every gram of the finished sequence ``ids`` that has a continuation."""
        ids = list(ids)
        w, table = self.window, self.table
        for end in range(w, len(ids)):
            key = tuple(ids[end - w:end])
            table[key] = (ids, end)
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def continuation(self, ids: list[int], num_tokens: int) -> list[int]:
        """What followed the suffix of ``ids`` in a finished sequence (empty: not found)."""
        if len(ids) < self.window:
            return []
        hit = self.table.get(tuple(ids[len(ids) - self.window:]))
        return [] if hit is None else hit[0][hit[1]:hit[1] + num_tokens]


class NgramIndex:
    """The window-size -> (w-gram -> latest end position) tables of one token sequence.

    Positions ``e <= indexed`` are in the tables; ``propose`` indexes every end position before
    the current one, so a look-up never finds the suffix itself."""

    def __init__(self, min_window: int, max_window: int,
                 shared: Optional[SharedNgramTable] = None) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.tables: dict[int, dict[tuple[int, ...], int]] = {
            w: {} for w in range(min_window, max_window + 1)}
        self.indexed = 0
        self.shared = shared

    def _index_until(self, ids: list[int], end: int) -> None:
        """Add every w-gram ending at positions ``(indexed, end]``."""
        for e in range(self.indexed + 1, end + 1):
            for w, table in self.tables.items():
                if e >= w:
                    table[tuple(ids[e - w:e])] = e
        self.indexed = max(self.indexed, end)

    def propose(self, ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens continuing ``ids`` (empty: no earlier match)."""
        n = len(ids)
        if num_tokens <= 0 or n < self.min_window + 1:
            return []
        self._index_until(ids, n - 1)
        if self.shared is not None:
            shared = self.shared.continuation(ids, num_tokens)
            if shared:
                return shared
        own = self._match(ids)
        if own is None:
            return []
        start = own
        draft: list[int] = []
        for j in range(num_tokens):
            pos = start + j
            draft.append(ids[pos] if pos < n else draft[pos - n])
        return draft

    def _match(self, ids: list[int]) -> Optional[int]:
        """End position of the latest earlier occurrence of the longest matching suffix."""
        n = len(ids)
        for w in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            e = self.tables[w].get(tuple(ids[n - w:]))
            if e is not None:
                return e
        return None


class NgramProposer:
    """One ``NgramIndex`` per running request, keyed by its arrival number (unique in one
    scheduler, unlike a rid, which a later request may reuse); ``forget`` drops finished ones.

    The index depends only on the request's tokens, so it survives retraction (the tokens are
    kept and recomputed) and needs nothing from the KV cache."""

    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram windows: need 1 <= min ({min_window}) <= max ({max_window})")
        self.min_window = min_window
        self.max_window = max_window
        self.indexes: dict[int, NgramIndex] = {}
        self.shared = SharedNgramTable(max_window)

    def propose(self, key: int, ids: list[int], num_tokens: int) -> list[int]:
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = NgramIndex(self.min_window, self.max_window,
                                                   self.shared)
        return index.propose(ids, num_tokens)

    def publish(self, ids: list[int]) -> None:
        """A finished request's tokens join the shared table."""
        self.shared.publish(ids)

    def forget(self, live: set[int]) -> None:
        """Drop the indexes of requests whose keys are not in ``live``."""
        for key in [k for k in self.indexes if k not in live]:
            del self.indexes[key]
