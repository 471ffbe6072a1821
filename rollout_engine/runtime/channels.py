"""Channels: one end of a message pipe between the frontend and a scheduler loop.

    QueueChannel   a pair of queues (the loop in a thread of this process)
    PipeChannel    a ``multiprocessing`` connection (the loop in a child process)
"""

from __future__ import annotations

import os
import queue
import threading
from abc import ABC, abstractmethod
from multiprocessing.connection import wait as wait_ready
from typing import Any, Optional

__all__ = ["Channel", "PipeChannel", "QueueChannel"]


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
    """One end of a loop run in a thread of this process: ``send`` puts on the outbox, the
    other end's inbox."""

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
