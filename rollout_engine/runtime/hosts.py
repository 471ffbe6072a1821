"""Where a scheduler loop runs: a thread of this process or a child process.

    ThreadHost    run_loop in a daemon thread, over a pair of queues
    ProcessHost   run_loop in a fresh interpreter (spawn_child), over a socket pair

A host gives the frontend its end of the channel, says whether the loop is alive, and stops
it within a bound.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from typing import Optional

from rollout_engine.config import EngineConfig
from rollout_engine.runtime.channels import Channel, PipeChannel, QueueChannel
from rollout_engine.runtime.loop import Shutdown, run_loop
from rollout_engine.runtime.spawn import ChildStart, spawn_child

__all__ = ["ProcessHost", "SchedulerHost", "ThreadHost", "start_host"]


class SchedulerHost(ABC):
    """Starts the loop somewhere; gives the frontend its channel end."""

    chan: Channel

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def stop(self, timeout: float) -> None: ...

    pid: Optional[int] = None


class ThreadHost(SchedulerHost):
    """The loop in a daemon thread of this process (``scheduler_mode="thread"``)."""

    def __init__(self, config: EngineConfig) -> None:
        to_sched: queue.Queue = queue.Queue()
        from_sched: queue.Queue = queue.Queue()
        self.chan = QueueChannel(from_sched, to_sched)
        self.thread = threading.Thread(
            target=run_loop, args=(config, QueueChannel(to_sched, from_sched)),
            name="rollout-scheduler", daemon=True)
        self.thread.start()
        self.pid = os.getpid()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float) -> None:
        self.chan.send(Shutdown())
        self.thread.join(timeout)


class ProcessHost(SchedulerHost):
    """The loop in a child process running ``rollout_engine.runtime.child`` (``spawn_child``).

    The config is the first message. The frontend's end sends from a sender thread
    (``PipeChannel(background_send=True)``). The child exits when this process does.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.proc, conn = spawn_child()
        self.pipe = PipeChannel(conn, background_send=True)
        self.chan = self.pipe
        self.pid = self.proc.pid
        try:
            self.chan.send(ChildStart(config, list(sys.path)))
        except OSError:
            pass   # the child died at once; the frontend reports it exited before it was ready

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        if self.is_alive():
            try:
                self.chan.send(Shutdown())
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.pipe.close_sender()


def start_host(config: EngineConfig) -> SchedulerHost:
    """One scheduler: a thread or a child process, as ``config.scheduler_mode`` says."""
    return ThreadHost(config) if config.scheduler_mode == "thread" else ProcessHost(config)
