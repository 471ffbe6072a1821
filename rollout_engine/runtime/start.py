"""``start_scheduler``: what ``Engine`` calls to get the host its frontend talks to."""

from __future__ import annotations

from rollout_engine.config import EngineConfig
from rollout_engine.runtime.dp_host import DataParallelHost
from rollout_engine.runtime.hosts import SchedulerHost, start_host

__all__ = ["start_scheduler"]


def start_scheduler(config: EngineConfig) -> SchedulerHost:
    """One scheduler (a thread or a child process), or ``dp_size`` of them behind one
    channel (``DataParallelHost``)."""
    if config.dp_size > 1:
        return DataParallelHost(config)
    return start_host(config)
