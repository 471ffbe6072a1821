"""The one generation of this process's model weights: every write to a parameter counts.

Every code path that writes parameters (copies bytes into them or gives them other storage)
does it inside ``with weight_writes.writing():``; nothing else announces a write. The block
moves the generation when it begins and again when it ends, also when it raised (a half write
is a change). Whatever is derived from weight values or storage depends on this number and on
nothing a writer has to know of:

- the packed copies (``weight_packs``) are keyed by the generation they were made under, and
  dropped as soon as it moves (they are as large as the weights: a sleep frees both);
- the scheduler's ``WeightState.generation``, which keys the radix cache, is this number as
  it stood after the last load (``WeightState.loaded`` / ``partly_written`` read it), so a
  prefix matched after a refit was computed with the weights it is served with.

A sleep and wake moves the generation (the weights' storage changed) but not the
scheduler's: its KV stays valid when the values came back from a backup, and a wake without
one leaves the weights stale until a load, which moves both.

``tests/rollout_engine/test_weight_writes.py`` checks that every parameter write in the
package sits inside the block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_counter = itertools.count(1)
_generation = 0
_listeners: list[Callable[[], None]] = []


def generation() -> int:
    """The current generation (0 before any write in this process)."""
    return _generation


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` (no I/O, no locks: it drops what it cached) whenever the generation
    moves. Registered once per cache, at import."""
    _listeners.append(listener)


def _move() -> None:
    global _generation
    _generation = next(_counter)
    for listener in _listeners:
        listener()


@contextmanager
def writing() -> Iterator[None]:
    """``with writing(): <write parameters>``: the generation moves before and after."""
    _move()
    try:
        yield
    finally:
        _move()
