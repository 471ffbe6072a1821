"""Integer knobs read from the environment (``ROLLOUT_ENGINE_*``), checked the same way."""

from __future__ import annotations

import os


def env_int(name: str, default: int, lo: int = 1, hi: int = 1 << 30) -> int:
    """``name``'s value when set (and not blank), else ``default``; ValueError naming the
    variable unless it is an integer in ``[lo, hi]``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {raw!r}")
    return int(raw)
