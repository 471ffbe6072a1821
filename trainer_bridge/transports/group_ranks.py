"""Who takes which rank in a weight-update group: the trainer is rank 0, then each engine's
ranks in turn, one per data-parallel replica times tensor-parallel rank (each receives the
broadcast, as SGLang's do)::

    engines   [plain, dp_size=2, plain]
    ranks     trainer 0 | engine 0: 1 | engine 1: 2, 3 | engine 2: 4      world size 5
    offsets   [1, 2, 4, 5]   (rank_offsets: each engine's first rank, then the world size)
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

__all__ = ["engine_ranks", "free_port", "rank_offsets", "rank_owner"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_ranks(engine: Any) -> int:
    """How many ranks an engine takes in a weight-update group: its data-parallel replicas
    times its tensor-parallel ranks (each receives the broadcast, as SGLang's do), 1 for a
    plain engine."""
    config = getattr(engine, "config", None)
    dp_size = getattr(config, "dp_size", None)
    if isinstance(dp_size, int):
        return dp_size * int(getattr(config, "tp_size", 1))
    try:
        info = engine.get_server_info()
    except Exception:  # noqa: BLE001 - a peer without server info is one rank
        return 1
    if not isinstance(info, dict):
        return 1
    return int(info.get("dp_size") or 1) * int(info.get("tp_size") or 1)


def rank_offsets(engines: Sequence[Any]) -> list[int]:
    """Engine i's first rank (`rank_offset`), and last the world size: trainer rank 0, then
    each engine's ranks in turn."""
    offsets = [1]
    for e in engines:
        offsets.append(offsets[-1] + engine_ranks(e))
    return offsets


def rank_owner(offsets: list[int], rank: int) -> int:
    """The index of the engine that holds `rank`."""
    return max(i for i in range(len(offsets) - 1) if offsets[i] <= rank)
