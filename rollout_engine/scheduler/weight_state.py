"""The weights the scheduler serves with, as one record it owns.

``version`` is the user's label (``weight_version``): it tags outputs and is never a cache key,
so relabelling neither hides nor invalidates KV. ``generation`` is the process's weight
generation (``models/weight_writes.py``, moved by every parameter write) as it stood after the
last load: every successful load (one bucket of a partial sync included) and every load that
failed after writing began takes the new one. It keys the radix cache, so a request never
reuses KV computed under older weights; the packed weight copies are keyed by the same number. ``missing`` holds the weights not written since a wake without a CPU backup
(or since a load failed halfway): while any is missing the weights are stale and nothing may be
generated. ``flush_pending`` is a refit's ``flush_cache`` waiting for the moment no request
holds KV (the scheduler's step runs it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from rollout_engine.models import weight_writes


@dataclass
class WeightState:
    version: str
    generation: int = 0
    missing: set[str] = field(default_factory=set)
    flush_pending: bool = False
    loads: int = 0   # loads since start (each bucket of a partial sync counts): see ``tag``

    @property
    def tag(self) -> str:
        """The weights as two servers that started from one checkpoint can compare them: the
        label and the number of loads since. A prefill server and a decode server refitted by
        the same calls agree on it; ``generation`` is this process's own."""
        return f"{self.version}#{self.loads}"

    @property
    def stale(self) -> bool:
        """Some weight holds no trained value (zeros after a wake, or half written)."""
        return bool(self.missing)

    def loaded(self, names: Iterable[str], version: Optional[str]) -> int:
        """A load wrote ``names``: a new generation; ``version`` relabels when given (SGLang
        leaves the label unchanged otherwise). Returns the new generation."""
        self._advance()
        if version is not None:
            self.version = version
        self.missing -= set(names)
        return self.generation

    def partly_written(self, names: Iterable[str]) -> int:
        """A load failed after writing began: ``names`` may be half overwritten and count as
        unwritten. Returns the new generation (the old one's KV no longer matches)."""
        self._advance()
        self.missing |= set(names)
        return self.generation

    def _advance(self) -> None:
        self.loads += 1
        # a load writes inside weight_writes.writing(), so the process's generation moved past
        # ours; one that wrote nothing still counts as a change
        self.generation = max(weight_writes.generation(), self.generation + 1)

    def zeroed(self, names: Iterable[str]) -> None:
        """Every weight was resumed without a backup (zeros): all of ``names`` are missing."""
        self.missing = set(names)
