"""The loop that routes typed messages between a channel and the scheduler.

    frontend --(GenerateReq | AbortReq | ControlReq | Shutdown)--> loop
    loop --(SchedulerReady, BatchOutput, ControlResult, SchedulerDied)--> frontend

The same loop runs in a thread (``ThreadHost``), a child process (``ProcessHost``) and on
tensor-parallel rank 0 (over a ``TPLeaderChannel``).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import traceback
from dataclasses import dataclass

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import SchedulerDied, SchedulerReady
from rollout_engine.runtime.channels import Channel

__all__ = ["Shutdown", "run_loop"]

logger = logging.getLogger(__name__)


@dataclass
class Shutdown:
    """Ends the loop: the scheduler shuts down and the loop returns."""


def run_loop(config: EngineConfig, chan: Channel) -> None:
    """Build the scheduler, announce it, then receive -> step -> send until Shutdown."""
    from rollout_engine.control.handlers import build_control
    from rollout_engine.speculative.scheduler import create_scheduler

    try:
        scheduler = create_scheduler(config)
        control = build_control(scheduler)
    except Exception as e:  # noqa: BLE001 - reported to the frontend, which raises it
        chan.send(SchedulerDied(f"scheduler failed to start: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc()}"))
        return
    control.wake = chan.wake
    if threading.current_thread() is threading.main_thread():   # the process is ours
        # what the scheduler built lives as long as it does (modules, model, tables: ~370k
        # objects): leave it out of the cyclic collector's full passes, each of which walked
        # all of it (~190 ms, once or twice a rollout, stalling the step it lands in)
        gc.collect()
        gc.freeze()
    chan.send(SchedulerReady(control.server_info()
                             | {"pid": os.getpid(), "vocab_size": scheduler.vocab_size,
                                "eos_token_ids": sorted(scheduler.eos_ids)}))
    try:
        while True:
            idle_wait = 0.5   # a deferred call's completion wakes the wait (control.wake)
            msg = chan.recv(timeout=0 if scheduler.has_work and scheduler.can_run else idle_wait)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    scheduler.shutdown()
                    return
                result = control.handle(msg)
                if result is not None:
                    chan.send(result)
                msg = chan.recv(timeout=0)
            out = scheduler.step()
            if out.outputs:
                chan.send(out)
            for result in control.finished():  # deferred control calls that ended
                chan.send(result)
    except (EOFError, BrokenPipeError, OSError):
        return  # the frontend went away
    except Exception as e:  # noqa: BLE001
        logger.exception("scheduler loop crashed")
        try:
            chan.send(SchedulerDied(f"scheduler crashed: {type(e).__name__}: {e}\n"
                                    f"{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
        raise
