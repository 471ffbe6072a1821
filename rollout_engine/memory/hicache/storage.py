"""The storage tier (L3): KV blocks by key, behind ``exists / get / set``, shared by engines.

A block is ``block_tokens`` consecutive tokens' KV rows (the host pool's page-first bytes). Its
key hashes everything that decides those bytes::

    key(b) = sha256(identity || token_ids[0 : (b + 1) * block_tokens])     (chained, O(n))
    identity = model config + dtype + KV shape + weight fingerprint + extra_key

so an engine on other weights (or another model) computes other keys and can never load a
block it did not compute the same way; after a refit the engine's own keys change too.

``FileStorage`` keeps one file per block in a directory that several engines of one user may
share: a block is written to a temporary file and renamed into place (readers see a whole block
or none), carries its own length, CRC and a digest of its key (a damaged file, or one moved
under another key, reads as a miss and is removed), and the directory is kept under
``max_bytes`` by deleting the least recently used blocks.

Whoever can write the directory decides what the engine serves from it, so it must be private:
``FileStorage`` creates it with mode 0700 and refuses one that another user owns or that group
or others may write. The default (`default_storage_dir`) is in the user's own cache directory,
never a shared path such as /tmp.
"""

from __future__ import annotations

import hashlib
import os
import queue
import stat
import struct
import threading
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Optional

__all__ = ["FileStorage", "HiCacheStorage", "StorageWriter", "block_keys", "create_storage",
           "default_storage_dir", "ensure_private_dir"]

_MAGIC = b"REKV2\0"
_HEADER = struct.Struct("<6sQI32s")   # magic, payload length, crc32, sha256 of the key


def default_storage_dir() -> str:
    """The file tier's directory when none is named: ``$XDG_CACHE_HOME/rollout_engine/hicache``
    (``~/.cache/...`` without it), private to the user running the engine."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rollout_engine", "hicache")


def ensure_private_dir(directory: str) -> None:
    """Create ``directory`` (mode 0700) if it is missing; raise ValueError if it, or a symbolic
    link to it, belongs to another user, or group or others may write it: blocks planted there
    would be served as KV."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    uid = os.getuid()
    where = f"hicache_storage_dir: {directory!r}"
    if os.path.islink(directory) and os.lstat(directory).st_uid != uid:
        raise ValueError(f"{where} is a symbolic link owned by uid "
                         f"{os.lstat(directory).st_uid}, not by this user ({uid}); name a "
                         "directory of your own")
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{where} is not a directory")
    if st.st_uid != uid:
        raise ValueError(f"{where} is owned by uid {st.st_uid}, not by this user ({uid}): "
                         "another user could plant KV blocks there; name a directory of your "
                         "own (created with mode 0700 if missing)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{where} may be written by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): another user could plant KV blocks "
                         "there; run chmod 700 on it, or name a private directory")


def block_keys(identity: bytes, token_ids: Sequence[int], block_tokens: int,
               num_blocks: int) -> list[str]:
    """Keys of the first ``num_blocks`` whole blocks of ``token_ids``."""
    h = hashlib.sha256(identity)
    keys = []
    for b in range(num_blocks):
        block = token_ids[b * block_tokens:(b + 1) * block_tokens]
        if len(block) < block_tokens:
            break
        h.update(struct.pack(f"<{block_tokens}q", *block))
        keys.append(h.copy().hexdigest())
    return keys


class HiCacheStorage(ABC):
    """A key -> bytes store for KV blocks. Methods may be called from two threads (the
    scheduler reads, the writer thread writes): implementations must be thread-safe."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True if ``get(key)`` would (most likely) return the block."""

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The block stored under ``key``, or None (absent, removed meanwhile, or damaged)."""

    @abstractmethod
    def set(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` atomically; False if it could not be stored."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the block under ``key`` if present (readers then miss it)."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every block this store can see."""


class FileStorage(HiCacheStorage):
    """One file per block under ``directory`` (two-character fan-out subdirectories)."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"hicache storage max_bytes must be >= 1, got {max_bytes}")
        ensure_private_dir(directory)
        self.directory = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._approx_bytes = self._scan_bytes()

    def _path(self, key: str) -> str:
        if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"storage key must be a hex digest, got {key!r}")
        return os.path.join(self.directory, key[:2], key + ".kv")

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def get(self, key: str) -> Optional[bytes]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        data = _unpack(raw, key)
        if data is None:
            _remove(path)       # damaged (never a torn write: those are renamed whole)
            return None
        try:
            os.utime(path)      # recency for eviction (shared by every engine)
        except FileNotFoundError:
            pass
        return data

    def set(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            return True
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        blob = _HEADER.pack(_MAGIC, len(data), zlib.crc32(data), _key_digest(key)) + data
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)   # atomic: a reader sees the old state or the whole block
        except OSError:
            _remove(tmp)
            return False
        with self._lock:
            self._approx_bytes += len(blob)
            over = self._approx_bytes > self.max_bytes
        if over:
            self._evict()
        return True

    def delete(self, key: str) -> None:
        _remove(self._path(key))

    def clear(self) -> None:
        for path, _, _ in self._entries():
            _remove(path)
        with self._lock:
            self._approx_bytes = 0

    def _entries(self) -> list[tuple[str, float, int]]:
        out = []
        for root, _, files in os.walk(self.directory):
            for name in files:
                if not name.endswith(".kv"):
                    continue
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append((path, st.st_mtime, st.st_size))
        return out

    def _scan_bytes(self) -> int:
        return sum(size for _, _, size in self._entries())

    def _evict(self) -> None:
        """Delete least recently used blocks until the directory is at 90% of ``max_bytes``
        (another engine may be evicting too: a file already gone is simply skipped)."""
        entries = sorted(self._entries(), key=lambda e: e[1])
        total = sum(size for _, _, size in entries)
        target = int(self.max_bytes * 0.9)
        for path, _, size in entries:
            if total <= target:
                break
            _remove(path)
            total -= size
        with self._lock:
            self._approx_bytes = total


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _unpack(raw: bytes, key: str) -> Optional[bytes]:
    """The payload of a block file read for ``key``; None if it is damaged, of another format,
    or was written for another key."""
    if len(raw) < _HEADER.size:
        return None
    magic, length, crc, digest = _HEADER.unpack_from(raw)
    data = raw[_HEADER.size:]
    if (magic != _MAGIC or digest != _key_digest(key) or len(data) != length
            or zlib.crc32(data) != crc):
        return None
    return data


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class StorageWriter:
    """Writes blocks on one background thread, so a backup never waits for the disk. The
    bytes are copied out of the host pool before they are queued: a host slot reused meanwhile
    cannot change what is written. ``flush()`` waits until every queued block is stored."""

    def __init__(self, storage: HiCacheStorage, max_queued: int = 1024) -> None:
        self.storage = storage
        self._queue: queue.Queue[Optional[tuple[str, bytes]]] = queue.Queue(max_queued)
        self.bytes_written = 0
        self.num_dropped = 0
        self.written: set[str] = set()   # keys this writer stored (read only after flush())
        self._thread = threading.Thread(target=self._run, name="hicache-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, data: bytes) -> None:
        try:
            self._queue.put_nowait((key, data))
        except queue.Full:
            self.num_dropped += 1   # the disk is behind: this block stays in L2 only

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, data = item
                if self.storage.set(key, data):
                    self.bytes_written += len(data)
                    self.written.add(key)
            finally:
                self._queue.task_done()


def create_storage(backend: Optional[str], directory: Optional[str],
                   max_bytes: int) -> Optional[HiCacheStorage]:
    """The storage tier for ``--hicache-storage-backend`` (None: no L3); the file backend in
    ``directory``, or `default_storage_dir` when it is None."""
    if backend is None:
        return None
    if backend == "file":
        return FileStorage(directory or default_storage_dir(), max_bytes)
    raise ValueError(f"hicache_storage_backend: {backend!r} is not built in (only 'file'; "
                     "mooncake, 3fs and nixl are not implemented)")
