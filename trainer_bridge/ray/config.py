"""`RayFleetConfig`: how a `RayRolloutFleet` places its engines (a placement group of one
bundle per engine, as verl, OpenRLHF and slime place theirs) and drives them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from rollout_engine.dp.dispatch import LOAD_BALANCE_METHODS
from trainer_bridge.weight_syncer import DEFAULT_BUCKET_BYTES, TRANSPORTS

__all__ = ["STRATEGIES", "RayFleetConfig"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")   # Ray's placement strategies


@dataclass(frozen=True)
class RayFleetConfig:
    """How the fleet places and drives its engines.

    num_cpus_per_engine / num_gpus_per_engine: each engine's bundle of the placement group and
    its actor's reservation (fractions allowed, e.g. 0.5 GPU when colocated with a trainer).
    base_gpu_id: None lets Ray choose the GPUs (each actor sees its own as cuda:0); an index
    pins engine i to GPU ``base_gpu_id + floor(i * num_gpus_per_engine)`` with every GPU
    visible to the actor (as slime places SGLang engines). max_concurrency: calls one actor
    serves at once (generation and control calls must not queue behind each other).
    timeout_s: bound on every control call and refit step (as `RolloutFleet`); start_timeout_s:
    on the placement group and the engines' start. transport / bucket_bytes: the refit path.
    """

    num_engines: int = 2
    num_cpus_per_engine: float = 1.0
    num_gpus_per_engine: float = 0.0
    base_gpu_id: Optional[int] = None
    placement_strategy: str = "PACK"
    load_balance_method: str = "cache_aware"
    max_concurrency: int = 32
    transport: str = "distributed"
    bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")
        if not isinstance(self.num_engines, int) or self.num_engines < 1:
            bad("num_engines", "must be an int >= 1")
        if not self.num_cpus_per_engine > 0:
            bad("num_cpus_per_engine", "must be > 0")
        if not self.num_gpus_per_engine >= 0:
            bad("num_gpus_per_engine", "must be >= 0")
        if self.base_gpu_id is not None and (not isinstance(self.base_gpu_id, int)
                                             or self.base_gpu_id < 0):
            bad("base_gpu_id", "must be None or a GPU index >= 0")
        if self.base_gpu_id is not None and self.num_gpus_per_engine == 0:
            bad("base_gpu_id", "needs num_gpus_per_engine > 0")
        if self.placement_strategy not in STRATEGIES:
            bad("placement_strategy", f"must be one of {STRATEGIES}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            bad("load_balance_method", f"must be one of {LOAD_BALANCE_METHODS}")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 2:
            bad("max_concurrency", "must be an int >= 2 (control calls beside generation)")
        if self.transport not in TRANSPORTS:
            bad("transport", f"must be one of {TRANSPORTS}")
        for name in ("timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0 seconds")

    def bundle(self) -> dict[str, float]:
        """One engine's resources (a placement-group bundle)."""
        bundle = {"CPU": float(self.num_cpus_per_engine)}
        if self.num_gpus_per_engine:
            bundle["GPU"] = float(self.num_gpus_per_engine)
        return bundle

    def engine_kwargs(self, index: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine `index`'s flags: the caller's, plus its device and (unless given) one
        intra-op thread per reserved CPU."""
        out = dict(kwargs)
        if self.num_gpus_per_engine:
            out.setdefault("device", "cuda")
            if self.base_gpu_id is not None:
                out["base_gpu_id"] = self.base_gpu_id + math.floor(index
                                                                   * self.num_gpus_per_engine)
        else:
            out.setdefault("device", "cpu")
        out.setdefault("num_threads", max(1, int(self.num_cpus_per_engine)))
        return out
