"""The prefill side: finished prompts' KV, held in shared memory and served on the bootstrap
port until a decode server fetches them.

``KVExporter`` owns every segment it creates and releases each exactly once: after the decode
server copied it (its ``done``, or the connection closing), when the connection fails, when no
decode server came for it within ``timeout_s``, or at ``close``. A room can be fetched once.
A request that ends without KV (aborted, refused) is published as failed, so the decode server
waiting for it fails at once instead of timing out. A process killed with segments still held
cannot release them: the next exporter to start on the host unlinks them.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.disaggregation.wire import (
    FirstToken,
    TransferError,
    boot_id,
    recv_header,
    send_header,
)

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_names = itertools.count()


@dataclass
class Export:
    """One room's KV: a segment file mapped as ``kv`` (bytes) and the first token's record."""

    record: FirstToken
    path: str
    kv: Optional[torch.Tensor]
    created: float

    def release(self) -> None:
        self.kv = None   # the mapping goes with the last reference
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def new_segment(nbytes: int) -> tuple[str, torch.Tensor]:
    """A fresh shared-memory file of ``nbytes`` mapped as a uint8 tensor."""
    path = os.path.join(_SHM_DIR, f"rollout_pd_{os.getpid()}_{next(_names)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    return path, torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


def sweep_stale_segments() -> int:
    """Unlink the segments of exporters whose process is gone (killed before it could release
    them); returns how many. Every exporter does this as it starts."""
    gone = 0
    for name in os.listdir(_SHM_DIR):
        parts = name.split("_")
        if len(parts) != 4 or parts[:2] != ["rollout", "pd"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue   # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue   # alive, another user's
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            gone += 1
        except FileNotFoundError:
            pass
    return gone


class KVExporter:
    """Rooms published by the scheduler, served to decode servers on ``host:port``."""

    def __init__(self, host: str, port: int, timeout_s: float, layout: dict[str, Any]) -> None:
        self.timeout_s = timeout_s
        self.layout = layout
        self.boot_id = boot_id()
        self._cond = threading.Condition()
        self._rooms: dict[str, Export] = {}
        self._failed: dict[str, tuple[str, float]] = {}
        self.stats = {"exported": 0, "fetched": 0, "expired": 0, "failed": 0, "bytes": 0}
        self.stats["swept"] = sweep_stale_segments()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="pd-bootstrap", daemon=True)
        self._thread.start()

    # -- the scheduler's side ------------------------------------------------------------------
    def publish(self, room: str, record: FirstToken, path: str, kv: torch.Tensor) -> None:
        with self._cond:
            old = self._rooms.pop(room, None)
            self._rooms[room] = Export(record, path, kv, time.monotonic())
            self.stats["exported"] += 1
            self._cond.notify_all()
        if old is not None:
            old.release()

    def fail(self, room: str, message: str) -> None:
        with self._cond:
            self._failed[room] = (message, time.monotonic())
            self.stats["failed"] += 1
            self._cond.notify_all()

    def held(self) -> int:
        """Rooms exported and not fetched yet (segments alive)."""
        with self._cond:
            return len(self._rooms)

    def close(self) -> None:
        self._closed = True
        with self._cond:
            rooms, self._rooms = list(self._rooms.values()), {}
            self._cond.notify_all()
        for export in rooms:
            export.release()
        self._sock.close()

    # -- the bootstrap port --------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed:
            self._expire()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="pd-export",
                             daemon=True).start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            old = [r for r, e in self._rooms.items() if now - e.created > self.timeout_s]
            gone = [self._rooms.pop(r) for r in old]
            for r in [r for r, (_, t) in self._failed.items() if now - t > self.timeout_s]:
                del self._failed[r]
            self.stats["expired"] += len(gone)
        for export in gone:
            logger.warning("no decode server fetched a prefill's KV within %.0f s; released",
                           self.timeout_s)
            export.release()

    def _take(self, room: str, wait_s: float) -> Export:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if room in self._rooms:
                    return self._rooms.pop(room)
                if room in self._failed:
                    raise TransferError(self._failed.pop(room)[0])
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TransferError(f"the prefill server has no KV for room {room!r} "
                                        f"after {wait_s:.0f} s")
                self._cond.wait(left)

    def _check(self, ask: dict[str, Any]) -> float:
        """A fetch's problems (TransferError); else how long it may wait for its room."""
        if ask.get("op") != "fetch" or not isinstance(ask.get("room"), str):
            raise TransferError("expected a fetch naming a room")
        if ask.get("layout") != self.layout:
            raise TransferError(f"KV layouts differ: prefill {self.layout}, decode "
                                f"{ask.get('layout')}")
        wait_s = ask.get("wait_s")
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or wait_s <= 0:
            return self.timeout_s
        return min(float(wait_s), self.timeout_s)

    def _answer(self, conn: socket.socket) -> None:
        export: Optional[Export] = None
        try:
            with conn:
                conn.settimeout(self.timeout_s)
                ask = recv_header(conn)
                try:
                    wait_s = self._check(ask)
                    export = self._take(ask["room"], wait_s)
                except TransferError as e:
                    send_header(conn, {"ok": False, "error": str(e)})
                    return
                assert export.kv is not None
                nbytes = export.kv.numel()
                by_name = bool(ask.get("shm")) and ask.get("boot_id") == self.boot_id
                send_header(conn, {"ok": True, "record": export.record.to_json(),
                                   "nbytes": nbytes, "shm_name": export.path if by_name
                                   else None})
                if by_name:
                    recv_header(conn)   # done (or the connection closes: released either way)
                else:
                    conn.sendall(memoryview(export.kv.numpy()))
                    recv_header(conn)
                with self._cond:
                    self.stats["fetched"] += 1
                    self.stats["bytes"] += nbytes
        except (OSError, TransferError) as e:
            logger.warning("a KV transfer ended early: %s", e)
        finally:
            if export is not None:
                export.release()
