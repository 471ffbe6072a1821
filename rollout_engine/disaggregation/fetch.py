"""The decode side: fetching a room's KV from the prefill server named by the request.

Transfers run on worker threads, never on the scheduler's loop. Each ends as one ``Received``
the scheduler collects with ``ready``: the first token's record and the KV bytes (a private
mapping of the prefill's segment on one host, or a buffer filled from the socket), or the
reason it failed. The scheduler calls ``Received.close`` once it copied the KV into its pool (or
gave up on it): the prefill server is told, and releases its segment. A request aborted while
its transfer runs is cancelled: its connection is shut, and its result dropped.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rollout_engine.disaggregation.export import _SHM_DIR
from rollout_engine.disaggregation.wire import (
    FirstToken,
    TransferError,
    boot_id,
    recv_header,
    recv_into,
    send_header,
)

BACKENDS = ("auto", "shm", "tcp")
_SEGMENT = re.compile(r"rollout_pd_\d+_\d+")
# the prefill server answers a room it lacks after the ``wait_s`` asked; the socket waits this
# much longer, so the request ends with the prefill's reason rather than a bare "timed out"
ANSWER_GRACE_S = 2.0


@dataclass
class Received:
    key: str
    req: Any
    record: Optional[FirstToken] = None
    kv: Optional[torch.Tensor] = None   # uint8, [nbytes]
    error: Optional[str] = None
    by_name: bool = False
    conn: Optional[socket.socket] = field(default=None, repr=False)

    def close(self) -> None:
        """The KV was copied (or will never be): tell the prefill server and hang up."""
        self.kv = None
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            send_header(conn, {"op": "done"})
        except OSError:
            pass
        finally:
            conn.close()


class KVFetcher:
    def __init__(self, layout: dict[str, Any], bytes_per_token: int, backend: str,
                 timeout_s: float, workers: int = 32) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"transfer backend must be one of {BACKENDS}, got {backend!r}")
        self.layout = layout
        self.bytes_per_token = bytes_per_token
        self.backend = backend
        self.timeout_s = timeout_s
        self.boot_id = boot_id()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pd-fetch")
        self._done: queue.Queue[Received] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[str, Optional[socket.socket]] = {}   # key -> its connection
        self.stats = {"fetched": 0, "failed": 0, "cancelled": 0, "bytes": 0, "by_name": 0}

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._live)

    def start(self, key: str, req: Any, host: str, port: int, room: str) -> None:
        with self._lock:
            self._live[key] = None
        self._pool.submit(self._run, key, req, host, port, room)

    def cancel(self, key: str) -> bool:
        """Stop ``key``'s transfer (True if it was still running); its result is dropped."""
        with self._lock:
            if key not in self._live:
                return False
            conn = self._live.pop(key)
            self.stats["cancelled"] += 1
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return True

    def ready(self) -> list[Received]:
        """Transfers that ended since the last call (cancelled ones are not among them)."""
        out = []
        while True:
            try:
                got = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                live = self._live.pop(got.key, "gone") != "gone"
            if live:
                out.append(got)
            else:
                got.close()

    def wait(self, timeout: float) -> None:
        """Block until a transfer ends or ``timeout`` passes (the loop's idle wait)."""
        try:
            got = self._done.get(timeout=timeout)
        except queue.Empty:
            return
        self._done.put(got)

    def close(self) -> None:
        with self._lock:
            keys = list(self._live)
        for key in keys:
            self.cancel(key)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for got in self.ready():
            got.close()

    # -- a worker ------------------------------------------------------------------------------
    def _run(self, key: str, req: Any, host: str, port: int, room: str) -> None:
        got = Received(key, req)
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout_s)
            with self._lock:
                if key not in self._live:
                    conn.close()
                    return
                self._live[key] = conn
            got.conn = conn
            conn.settimeout(self.timeout_s + ANSWER_GRACE_S)
            send_header(conn, {"op": "fetch", "room": room, "layout": self.layout,
                               "boot_id": self.boot_id, "shm": self.backend != "tcp",
                               "wait_s": self.timeout_s})
            self._receive(got, conn)
            with self._lock:
                self.stats["fetched"] += 1
                self.stats["by_name"] += got.by_name
                self.stats["bytes"] += 0 if got.kv is None else got.kv.numel()
        except (OSError, TransferError, ValueError) as e:
            got.error = (f"KV transfer from the prefill server {host}:{port} (room {room}) "
                         f"failed: {e}")
            got.close()
            with self._lock:
                self.stats["failed"] += 1
        self._done.put(got)

    def _receive(self, got: Received, conn: socket.socket) -> None:
        header = recv_header(conn)
        if header.get("ok") is not True:
            raise TransferError(str(header.get("error", "the prefill server refused")))
        record = FirstToken.from_json(header.get("record"))
        nbytes = header.get("nbytes")
        expected = len(record.input_ids) * self.bytes_per_token
        if nbytes != expected:
            raise TransferError(f"{nbytes} bytes of KV announced for {len(record.input_ids)} "
                                f"tokens; the layout needs {expected}")
        got.record = record
        name = header.get("shm_name")
        if name is not None:
            if self.backend == "tcp":
                raise TransferError("the prefill server offered shared memory to a tcp fetch")
            got.kv = _open_segment(name, expected)
            got.by_name = True
            return
        if self.backend == "shm":
            raise TransferError("the prefill server is on another host: the shm transfer "
                                "backend needs both on one (use auto or tcp)")
        buf = torch.empty(expected, dtype=torch.uint8)
        recv_into(conn, memoryview(buf.numpy()))
        got.kv = buf


def _open_segment(name: Any, nbytes: int) -> torch.Tensor:
    """Map the prefill's segment ``name`` read-only after checking it is one of its kind."""
    if not isinstance(name, str) or os.path.dirname(name) != _SHM_DIR or \
            not _SEGMENT.fullmatch(os.path.basename(name)):
        raise TransferError(f"{name!r} is not a KV segment")
    try:
        size = os.stat(name).st_size
    except OSError as e:
        raise TransferError(f"the KV segment is gone: {e}") from None
    if size != max(nbytes, 1):
        raise TransferError(f"the KV segment holds {size} bytes, {nbytes} were announced")
    return torch.from_file(name, shared=False, size=nbytes, dtype=torch.uint8)
