"""The LoRA flags of ``EngineConfig`` (SGLang's names), checked and normalised in one place.

    enable_lora          serve LoRA adapters (implied by lora_paths, as in SGLang)
    lora_paths           adapters loaded at start: "NAME=DIR", "DIR" (named DIR), a JSON object
                         {"lora_name", "lora_path", "pinned"}, or a dict NAME -> DIR; kept as
                         a list of {"lora_name", "lora_path", "pinned"}
    max_loras_per_batch  adapter slots of the pool: distinct adapters one batch may use
    max_lora_rank        the largest rank an adapter may have (None: the largest of lora_paths')
    lora_target_modules  the projections adapters may target (None: those of lora_paths'; "all")
    max_loaded_loras     adapters loaded at once (None: no limit)

SGLang's rule: without lora_paths, max_lora_rank and lora_target_modules size the pool and must
be given. Not combined (refused naming the flag): tensor or data parallelism, the hierarchical
cache (its storage keys do not name an adapter), speculative decoding (its drafts and verify
forwards do not apply adapters).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from rollout_engine.models.lora import MODULES

__all__ = ["check_lora", "normalized_lora_paths", "target_modules"]

ALL_MODULES = ("all", "all-linear")


def normalized_lora_paths(value: Any) -> list[dict[str, Any]]:
    """Every form SGLang's ``--lora-paths`` takes -> ``[{"lora_name", "lora_path", "pinned"}]``
    (ValueError naming the entry otherwise)."""
    if value is None:
        return []
    if isinstance(value, dict) and not {"lora_name", "lora_path"} <= value.keys():
        value = [{"lora_name": k, "lora_path": v} for k, v in value.items()]   # NAME -> DIR
    entries = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for entry in entries:
        if isinstance(entry, str) and entry.strip().startswith("{"):
            try:
                entry = json.loads(entry)
            except ValueError as e:
                raise ValueError(f"{entry!r} looks like JSON but does not parse: {e}") from None
        if isinstance(entry, str):
            name, sep, path = entry.strip().partition("=")
            entry = {"lora_name": name, "lora_path": path} if sep else {
                "lora_name": entry.strip(), "lora_path": entry.strip()}
        if not isinstance(entry, dict) or not {"lora_name", "lora_path"} <= entry.keys() or \
                set(entry) - {"lora_name", "lora_path", "pinned"}:
            raise ValueError(f"{entry!r} is none of NAME=DIR, DIR or an object with lora_name, "
                             "lora_path (and pinned)")
        name, path, pinned = entry["lora_name"], entry["lora_path"], entry.get("pinned", False)
        if not isinstance(name, str) or not name or not isinstance(path, (str, os.PathLike)) \
                or not str(path) or not isinstance(pinned, bool):
            raise ValueError(f"{entry!r}: lora_name and lora_path must be non-empty strings and "
                             "pinned a boolean")
        out.append({"lora_name": name, "lora_path": str(path), "pinned": pinned})
    return out


def target_modules(value: Any) -> frozenset[str]:
    """``lora_target_modules`` -> the projections (``all`` / ``all-linear``: every one)."""
    names = [value] if isinstance(value, str) else list(value)
    if any(n in ALL_MODULES for n in names):
        return frozenset(MODULES)
    return frozenset(names)


def check_lora(c: Any, bad: Callable[[str, str], None]) -> None:
    """Call ``bad(flag, why)`` for a LoRA setting that cannot be honoured; normalises
    ``lora_paths`` and sets ``enable_lora`` when adapters are given (``c`` is frozen)."""
    try:
        paths = normalized_lora_paths(c.lora_paths)
    except ValueError as e:
        bad("lora_paths", str(e))
    object.__setattr__(c, "lora_paths", paths or None)
    if paths:
        object.__setattr__(c, "enable_lora", True)
    if c.max_loras_per_batch < 1:
        bad("max_loras_per_batch", f"must be >= 1, got {c.max_loras_per_batch}")
    if c.max_lora_rank is not None and c.max_lora_rank < 1:
        bad("max_lora_rank", f"must be >= 1, got {c.max_lora_rank}")
    modules = c.lora_target_modules
    if modules is not None:
        if not isinstance(modules, (str, list, tuple)) or not modules or not all(
                isinstance(m, str) for m in ([modules] if isinstance(modules, str) else modules)):
            bad("lora_target_modules", f"must be a list of module names, got {modules!r}")
        unknown = sorted(target_modules(modules) - set(MODULES))
        if unknown:
            bad("lora_target_modules", f"{unknown} are not supported: LoRA applies to "
                f"{', '.join(MODULES)} (or 'all')")
    if not c.enable_lora:
        return
    for flag, on in (("tp_size", c.tp_size > 1), ("dp_size", c.dp_size > 1),
                     ("enable_hierarchical_cache", c.enable_hierarchical_cache),
                     ("speculative_algorithm", c.speculative_algorithm is not None)):
        if on:
            bad("enable_lora", f"is not supported with {flag}={getattr(c, flag)!r} yet")
    if not paths and (c.max_lora_rank is None or c.lora_target_modules is None):
        bad("enable_lora", "without lora_paths, give max_lora_rank and lora_target_modules "
            "(they size the adapter pool; SGLang's rule)")
    names = [p["lora_name"] for p in paths]
    if len(set(names)) != len(names):
        bad("lora_paths", f"adapter names must be unique, got {names}")
    for p in paths:
        if not os.path.isfile(os.path.join(p["lora_path"], "adapter_config.json")):
            bad("lora_paths", f"{p['lora_path']!r} (adapter {p['lora_name']!r}) is not a PEFT "
                "adapter directory (no adapter_config.json)")
    if c.max_loaded_loras is not None and c.max_loaded_loras < max(c.max_loras_per_batch,
                                                                   len(paths)):
        bad("max_loaded_loras", f"must be >= max_loras_per_batch ({c.max_loras_per_batch}) and "
            f">= the number of lora_paths ({len(paths)}), got {c.max_loaded_loras}")
