"""The trainer side of RL with rollout_engine: talk to servers, push weights (or only a LoRA
adapter), sleep and wake.

Imports `rollout_engine.protocol` only; engines are passed in (an `Engine` or a
`RolloutClient`), never created here.
"""

from trainer_bridge.client import AsyncRolloutClient, Rollout, RolloutClient, RolloutError
from trainer_bridge.colocate import SleepReport, engine_sleeping
from trainer_bridge.fleet import (
    EngineResult,
    FleetError,
    FleetRefitError,
    FleetReport,
    RolloutFleet,
)
from trainer_bridge.lora_syncer import LoraSyncer, LoraSyncReport
from trainer_bridge.weight_syncer import SyncReport, WeightSyncer

__all__ = [
    "AsyncRolloutClient",
    "EngineResult",
    "FleetError",
    "FleetRefitError",
    "FleetReport",
    "LoraSyncReport",
    "LoraSyncer",
    "Rollout",
    "RolloutClient",
    "RolloutError",
    "RolloutFleet",
    "SleepReport",
    "SyncReport",
    "WeightSyncer",
    "engine_sleeping",
]
