"""The scheduler's event loop and the two ways to host it: a thread or a child process.

    frontend --(GenerateReq | AbortReq | ControlReq | Shutdown)--> loop
    loop --(SchedulerReady, BatchOutput, ControlResult, SchedulerDied)--> frontend
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import traceback
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import SchedulerDied, SchedulerReady

logger = logging.getLogger(__name__)


@dataclass
class Shutdown:
    pass


class Channel(ABC):
    """One end of a message pipe."""

    @abstractmethod
    def send(self, msg: Any) -> None: ...

    @abstractmethod
    def recv(self, timeout: Optional[float]) -> Any:
        """The next message, or None after ``timeout`` seconds (None = wait forever)."""


class QueueChannel(Channel):
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, msg: Any) -> None:
        self.outbox.put(msg)

    def recv(self, timeout: Optional[float]) -> Any:
        try:
            return self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None


class PipeChannel(Channel):
    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.lock:
            self.conn.send(msg)

    def recv(self, timeout: Optional[float]) -> Any:
        if timeout is not None and not self.conn.poll(timeout):
            return None
        return self.conn.recv()


def run_loop(config: EngineConfig, chan: Channel) -> None:
    """Build the scheduler, announce it, then receive -> step -> send until Shutdown."""
    from rollout_engine.scheduler.scheduler import Scheduler

    try:
        scheduler = Scheduler(config)
    except Exception as e:  # noqa: BLE001 - reported to the frontend, which raises it
        chan.send(SchedulerDied(f"scheduler failed to start: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc()}"))
        return
    chan.send(SchedulerReady(scheduler.control.rpc_get_server_info()
                             | {"pid": os.getpid(), "vocab_size": scheduler.vocab_size,
                                "eos_token_ids": sorted(scheduler.eos_ids)}))
    try:
        while True:
            msg = chan.recv(timeout=0 if scheduler.has_work and scheduler.can_run else 0.5)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    scheduler.shutdown()
                    return
                result = scheduler.handle(msg)
                if result is not None:
                    chan.send(result)
                msg = chan.recv(timeout=0)
            out = scheduler.step()
            if out.outputs:
                chan.send(out)
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


def _process_main(config: EngineConfig, conn: Any) -> None:
    logging.basicConfig(level=config.log_level.upper())
    try:
        run_loop(config, PipeChannel(conn))
    except Exception:  # noqa: BLE001
        os._exit(1)


class SchedulerHost(ABC):
    """Starts the loop somewhere; gives the frontend its channel end."""

    chan: Channel

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def stop(self, timeout: float) -> None: ...

    pid: Optional[int] = None


class ThreadHost(SchedulerHost):
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
    def __init__(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_process_main, args=(config, child),
                                name="rollout-scheduler", daemon=True)
        # OpenMP workers that spin while waiting make small decode matmuls ~5x slower when the
        # cores are shared (the frontend, a colocated trainer); the child reads this at import.
        with _env(OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")):
            self.proc.start()
        child.close()
        self.chan = PipeChannel(parent)
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self, timeout: float) -> None:
        if self.proc.is_alive():
            try:
                self.chan.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_scheduler(config: EngineConfig) -> SchedulerHost:
    return ThreadHost(config) if config.scheduler_mode == "thread" else ProcessHost(config)
