"""Rollout engines as Ray actors (the optional extra ``ray``: ``pip install -e ".[ray]"``).

Importing this package does not import Ray; creating a fleet does.
"""

from trainer_bridge.ray.config import RayFleetConfig
from trainer_bridge.ray.engine import ENGINE_METHODS, EngineActor, EngineActorDiedError, RayEngine
from trainer_bridge.ray.fleet import RayRolloutFleet
from trainer_bridge.ray.local import LOCAL_ONLY_ENV, start_local_ray

__all__ = ["ENGINE_METHODS", "LOCAL_ONLY_ENV", "EngineActor", "EngineActorDiedError",
           "RayEngine", "RayFleetConfig", "RayRolloutFleet", "start_local_ray"]
