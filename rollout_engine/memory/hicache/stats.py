"""Counters of the hierarchical cache (reported by get_server_info and /metrics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["HiCacheStats"]


@dataclass
class HiCacheStats:
    """Hit tokens per tier (counted once per admitted request), bytes moved between tiers,
    and the time spent loading host pages back into the device pool."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    host_written_tokens: int = 0
    host_evicted_tokens: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    num_loads: int = 0              # bulk host -> device copies (at most one per step)
    load_seconds: float = 0.0       # slot allocation at admission + the bulk copies

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
