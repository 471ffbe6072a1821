"""The scheduler's event loop and the two ways to host it: a thread or a child process.

    frontend --(GenerateReq | AbortReq | ControlReq | Shutdown)--> loop
    loop --(SchedulerReady, BatchOutput, ControlResult, SchedulerDied)--> frontend
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import Any, Optional

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import SchedulerDied, SchedulerReady

logger = logging.getLogger(__name__)

# The child imports the same rollout_engine as this process, first on its path: a
# ``rollout_engine`` folder in the working directory must not shadow it (``python -m`` would
# put the working directory first).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD_BOOT = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from rollout_engine.scheduler.child import main; sys.exit(main())")


@dataclass
class Shutdown:
    pass


class Channel(ABC):
    """One end of a message pipe."""

    @abstractmethod
    def send(self, msg: Any) -> None: ...

    def send_many(self, msgs: list[Any]) -> None:
        """The requests of one generate call, in order (a data-parallel channel keeps a GRPO
        group together)."""
        for msg in msgs:
            self.send(msg)

    @abstractmethod
    def recv(self, timeout: Optional[float]) -> Any:
        """The next message, or None after ``timeout`` seconds (None = wait forever) or
        once `wake` was called (from any thread)."""

    def wake(self) -> None:  # noqa: B027 - a frontend's end needs none
        """End the current (or next) `recv` wait early, with None (the loop's end of a
        channel; a frontend's end is never woken)."""


_WAKE = object()
_CLOSE = object()


class QueueChannel(Channel):
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, msg: Any) -> None:
        self.outbox.put(msg)

    def recv(self, timeout: Optional[float]) -> Any:
        try:
            msg = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        return None if msg is _WAKE else msg

    def wake(self) -> None:
        self.inbox.put(_WAKE)


class PipeChannel(Channel):
    """A channel over a ``multiprocessing`` connection.

    ``background_send`` (the frontend's end): ``send`` only puts the message on a queue and one
    sender thread pickles and writes it. A caller (the HTTP event loop) never waits on a full
    pipe while the scheduler is busy, and pickling never happens under a lock a finalizer or
    another caller could want (a finalizer that ran inside a pickle under the send lock and
    sent too once deadlocked the whole server). ``queue.SimpleQueue.put`` is reentrant.
    Without it (the scheduler's end), ``send`` writes under a lock in the caller's thread.
    """

    def __init__(self, conn: Any, *, background_send: bool = False) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()   # `wake` writes a byte; `recv` waits on both
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.send_error: Optional[BaseException] = None   # why the sender thread stopped
        self._outbox: Optional[queue.SimpleQueue] = None
        if background_send:
            self._outbox = queue.SimpleQueue()
            threading.Thread(target=self._send_forever, name="rollout-sender",
                             daemon=True).start()

    def send(self, msg: Any) -> None:
        if self._outbox is None:
            with self.lock:
                self.conn.send(msg)
            return
        if self.send_error is not None:
            raise BrokenPipeError(f"the scheduler's pipe is closed: {self.send_error}")
        self._outbox.put(msg)

    def close_sender(self) -> None:
        """Let the sender thread end once what was sent before is written."""
        if self._outbox is not None:
            self._outbox.put(_CLOSE)

    def _send_forever(self) -> None:
        assert self._outbox is not None
        while True:
            msg = self._outbox.get()
            if msg is _CLOSE:
                return
            try:
                self.conn.send(msg)   # the only writer: no lock
            except (OSError, ValueError) as e:   # the scheduler is gone (closed / broken pipe)
                self.send_error = e
                return
            del msg   # a large payload is not kept alive while the queue is empty

    def recv(self, timeout: Optional[float]) -> Any:
        if not self.conn.poll(0):
            if timeout == 0:
                return None
            ready = wait_ready([self.conn, self._wake_r], timeout)
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self.conn not in ready:
                return None
        return self.conn.recv()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass   # the pipe is full: a wake is already pending


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
    """The loop in a child process running ``rollout_engine.scheduler.child``.

    A fresh interpreter, not multiprocessing's spawn: spawn re-imports the caller's main module,
    so a script without an ``if __name__ == "__main__":`` guard would start a second Engine in
    the child and die with a bare EOFError. The two ends talk over an inherited socket pair
    (nothing listens, so no other process can connect); the config is the first message. The
    child exits when this process does (end-of-file, or its parent pid going away).
    """

    def __init__(self, config: EngineConfig) -> None:
        from rollout_engine.scheduler.child import ChildStart

        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # OpenMP's waits (the child reads these at import). Workers that spin for long (libgomp's
        # default: 300k spins, ~3 ms; ACTIVE: for good) made small decode matmuls ~5x slower when
        # the cores are shared (the frontend, a colocated trainer); purely passive ones sleep
        # after every parallel region, and the next one (a forward has ~150, a few us of Python
        # apart) waits for the futex wake-up: offline batch 64 ran at ~1,750 tok/s that way and
        # at ~2,400 with a short spin (10k spins, ~0.1 ms) first, batch 128 +15%, serving +5-10%
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("GOMP_SPINCOUNT", "10000")
        # oneDNN's primitive cache (models/layers.linear; keyed by shapes, ~5 a row count for a
        # decoder, ~0.7 MB each) is read once when torch loads, so only a child can set it.
        # linear buckets row counts (80 up to 256 rows, 16 an octave above), so its default
        # of 1024 holds every decode batch size and the common prefill lengths; a larger one
        # only lets the process keep more memory it will rarely reuse
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
        # (no THP_MEM_ALLOC_ENABLE: the weights, the KV pool and the refit spares ask for huge
        # pages themselves, memory/huge_pages.py; torch's allocator would ask for every
        # activation of 2 MB or more too, and each then waits on the kernel compacting memory)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_BOOT, _PACKAGE_ROOT, str(theirs.fileno()),
                 str(os.getpid())], pass_fds=[theirs.fileno()], env=env,
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.chan = PipeChannel(Connection(ours.detach()), background_send=True)
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
        self.chan.close_sender()


def start_scheduler(config: EngineConfig) -> SchedulerHost:
    """One scheduler (a thread or a child process), or ``dp_size`` of them behind one
    channel (rollout_engine/dp)."""
    if config.dp_size > 1:
        from rollout_engine.dp.host import DataParallelHost

        return DataParallelHost(config)
    return ThreadHost(config) if config.scheduler_mode == "thread" else ProcessHost(config)
