"""The weights the scheduler serves with, as one record it owns.

``version`` is the user's label (``weight_version``): it tags outputs and is never a cache key,
so relabelling neither hides nor invalidates KV. ``generation`` is an internal counter bumped by
every weight change (every successful load, one bucket of a partial sync included, and a load
that failed after writing began); it keys the radix cache, so a request never reuses KV computed
under older weights. ``missing`` holds the weights not written since a wake without a CPU backup
(or since a load failed halfway): while any is missing the weights are stale and nothing may be
generated. ``flush_pending`` is a refit's ``flush_cache`` waiting for the moment no request
holds KV (the scheduler's step runs it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class WeightState:
    version: str
    generation: int = 0
    missing: set[str] = field(default_factory=set)
    flush_pending: bool = False

    @property
    def stale(self) -> bool:
        """Some weight holds no trained value (zeros after a wake, or half written)."""
        return bool(self.missing)

    def loaded(self, names: Iterable[str], version: Optional[str]) -> int:
        """A load wrote ``names``: a new generation; ``version`` relabels when given (SGLang
        leaves the label unchanged otherwise). Returns the new generation."""
        self.generation += 1
        if version is not None:
            self.version = version
        self.missing -= set(names)
        return self.generation

    def partly_written(self, names: Iterable[str]) -> int:
        """A load failed after writing began: ``names`` may be half overwritten and count as
        unwritten. Returns the new generation (the old one's KV no longer matches)."""
        self.generation += 1
        self.missing |= set(names)
        return self.generation

    def zeroed(self, names: Iterable[str]) -> None:
        """Every weight was resumed without a backup (zeros): all of ``names`` are missing."""
        self.missing = set(names)
