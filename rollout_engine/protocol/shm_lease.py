"""CPU tensor handles lent for one call: the sender owns every shared-memory reference.

    sender (trainer)                                 receiver (engine, any process)
    lend: the storage moved into /dev/shm in place   open_lent: mmap of /dev/shm/<name> past
      (torch's file_system sharing) and sent by        torch's 64-byte header; no shm reference
      name; an `ShmLease` keeps it alive until the     taken or dropped, no connection to the
      call is answered, whatever the answer            sender's torch_shm_manager

One owner, so nothing is released twice or never:

- the sender's `ShmLease` holds the storages (plain Python references, no shm refcount) from
  serializing until the engine's answer, a refusal, a timeout or a failed request; `release`
  lets go, and a storage nobody else holds is then unmapped and its file unlinked by torch;
- the receiver's mapping is its own: it outlives an unlink of the name, so the sender may free
  its tensors as soon as the call is answered, and what the receiver keeps mapped (a refit's
  cache of recent payloads) pins memory, never a name in /dev/shm;
- a sender that dies is cleaned up by its own torch_shm_manager, which unlinks the sender's
  files and exits once its last client is gone: the receiver never became one.

A lent handle is the pickle global `rebuild_lent_storage(name, num_bytes)`. Payloads that use
torch's own `rebuild_storage_filename` (SGLang's serializer under the file_system strategy) keep
torch's protocol, one reference taken for the receiver, which drops it on opening
(`tensor_handles.ShmStorage`).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections.abc import Iterable

import torch
from torch.multiprocessing import reductions

__all__ = ["LENT_STORAGE_GLOBAL", "SHM_NAME", "ShmLease", "check_shm_name", "lend_storage",
           "open_lent", "rebuild_lent_storage"]

SHM_DIR = "/dev/shm"
SHM_HEADER_BYTES = 64
"""RefcountedMapAllocator's header before the data in every torch shm file."""

LENT_STORAGE_GLOBAL = (__name__, "rebuild_lent_storage")
"""The (module, name) a lent handle pickles as."""

SHM_NAME = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
"""The shm names torch creates (at::NewProcessWideShmHandle)."""


class ShmLease:
    """The storages one serialized payload names, kept alive until `release` (idempotent).

    Holding them keeps their shm files named, so the receiver can open the handles while the
    call is in flight even if the caller dropped its tensors. No finalizer: an unreleased
    lease that is garbage-collected lets go exactly as `release` does."""

    def __init__(self, storages: Iterable[torch.UntypedStorage] = ()) -> None:
        self._storages: list[torch.UntypedStorage] = list(storages)

    @property
    def num_storages(self) -> int:
        return len(self._storages)

    def release(self) -> None:
        """Let go of every storage (those nobody else holds are unmapped, their files
        unlinked)."""
        self._storages = []

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lend_storage(storage: torch.UntypedStorage) -> tuple[bytes, int]:
    """Move a CPU storage into shared memory in place (a no-op once it is there) and return
    its (shm name, bytes); takes no shm reference. A reader in this process finds the storage
    itself by its name (torch's handle cache, weakly held) instead of mapping it again."""
    if storage.device.type != "cpu":
        raise ValueError(f"cannot send a bare {storage.device} storage; send a tensor instead")
    _manager, handle, num_bytes = storage._share_filename_cpu_()
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return handle, num_bytes


def check_shm_name(handle: bytes) -> str:
    """The path of a torch shm file named `handle`; ValueError for any other name."""
    name = handle.decode("ascii", "replace") if isinstance(handle, bytes) else ""
    if not SHM_NAME.fullmatch(name):
        raise ValueError(f"shared-memory name {name!r} is not one torch creates "
                         "(/torch_<pid>_<random>_<counter>)")
    return SHM_DIR + name   # "/torch_...": no separator, no "..", checked above


def open_lent(handle: bytes, num_bytes: int) -> torch.UntypedStorage:
    """Map the `num_bytes` data bytes of the shm file `handle` (a storage over the mapping,
    which lives as long as the storage does; in the lending process, its own storage).
    Refuses a file that is not a regular file or is
    shorter than its header plus `num_bytes` (mapping past the end would fault on access)."""
    path = check_shm_name(handle)
    if num_bytes == 0:
        return torch.UntypedStorage(0)
    own = reductions.storage_from_cache(torch.UntypedStorage, handle)
    if own is not None and own.nbytes() >= num_bytes:
        return own   # lent by this very process: its own storage, nothing to map
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"shared-memory file {handle.decode()!r} cannot be opened "
                         f"({exc.strerror}); was the sender's tensor freed?") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < SHM_HEADER_BYTES + num_bytes:
            raise ValueError(f"shared memory {handle.decode()!r} holds "
                             f"{max(st.st_size - SHM_HEADER_BYTES, 0)} bytes, not the "
                             f"{num_bytes} its handle claims")
        mapping = mmap.mmap(fd, SHM_HEADER_BYTES + num_bytes, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # the storage keeps `mapping` alive; it is unmapped once the storage is freed
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes,
                            offset=SHM_HEADER_BYTES).untyped_storage()


def rebuild_lent_storage(handle: bytes, num_bytes: int) -> torch.UntypedStorage:
    """What a lent handle unpickles to outside the restricted reader (`open_lent`)."""
    return open_lent(handle, num_bytes)
