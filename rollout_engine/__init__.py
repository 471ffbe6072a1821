"""rollout_engine: an RL rollout and weight-refit serving engine with SGLang's API."""

from rollout_engine.config import EngineConfig
from rollout_engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in transformers and the scheduler; import it on first use.
    if name == "Engine":
        from rollout_engine.entrypoints.engine import Engine
        return Engine
    raise AttributeError(name)
