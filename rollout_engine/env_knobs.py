"""Integer knobs read from the environment (``ROLLOUT_ENGINE_*``), checked the same way."""

from __future__ import annotations

import os
from typing import Optional


def env_int(name: str, default: int, lo: int = 1, hi: Optional[int] = None) -> int:
    """``name``'s value when set (and not blank), else ``default``; ValueError naming the
    variable unless it is an integer >= ``lo`` (and <= ``hi`` when given)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < lo or (hi is not None and int(raw) > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: must be an integer {bounds}, got {raw!r}")
    return int(raw)
