"""The pure checks a payload's handles pass before anything is mapped, and the refusal they raise.

Every check takes plain values (names, sizes, strides, dtypes) and either returns them vetted or
raises `UnsafePayloadError` naming what was wrong; none opens or maps memory. The only file-system
reads are `os.lstat`s: a shm file's size (`shm_file_bytes`) and a manager socket's existence
(`check_manager_socket`). `PayloadBudget` counts the storage bytes one payload may map.

The forms admitted are the ones torch itself creates (torch 2.x, Linux):

    shm name        /torch_<pid>_<random>_<counter>     at::NewProcessWideShmHandle(); the file
                    is /dev/shm/torch_..., 64 header bytes + the storage (RefcountedMapAllocator)
    manager socket  <tmp>/torch-shm-dir-XXXXXX/manager.sock    torch_shm_manager (mkdtemp)
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

import torch

from rollout_engine.protocol.shm_lease import SHM_DIR, SHM_HEADER_BYTES, SHM_NAME

__all__ = [
    "PayloadBudget",
    "UnsafePayloadError",
    "as_bytes",
    "check_dtype",
    "check_layout",
    "check_manager_socket",
    "is_int",
    "required_bytes",
    "shm_file_bytes",
]

_MANAGER_SOCKET = re.compile(r"(/[A-Za-z0-9._+@,=~-]+)*/torch-shm-dir-[A-Za-z0-9]{6}/manager\.sock")
_MAX_DIMS = 64


class UnsafePayloadError(ValueError):
    """A tensor payload referred to a global, used an opcode or named a handle that is not
    allowed."""


class PayloadBudget:
    """Bytes of storage one payload (with its nested payloads) may map: each storage once."""

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes: must be a non-negative int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used = 0
        self._seen: set[Any] = set()

    def charge(self, key: Any, num_bytes: int, what: str | Callable[[], str]) -> None:
        """Count `num_bytes` once per `key`; `what` (or what it returns) names it in the
        refusal."""
        if key in self._seen:
            return
        if self.used + num_bytes > self.max_bytes:
            if callable(what):
                what = what()
            raise UnsafePayloadError(
                f"tensor payload asks for {self.used + num_bytes} bytes of storage ({what}: "
                f"{num_bytes}), over this receiver's cap of {self.max_bytes} bytes"
            )
        self._seen.add(key)
        self.used += num_bytes


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS or not all(
        is_int(v) and v >= 0 for v in value
    ):
        raise UnsafePayloadError(f"{what} must be a tuple of at most {_MAX_DIMS} "
                                 f"non-negative ints, got {value!r}")
    return tuple(value)


def check_dtype(dtype: Any, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise UnsafePayloadError(f"{what}: dtype must be a torch dtype, got {dtype!r}")
    return dtype


def as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) > 4096:
        raise UnsafePayloadError(f"{what} must be bytes, got {type(value).__name__}")
    return value


def required_bytes(size: tuple[int, ...], stride: tuple[int, ...], offset: int,
                   itemsize: int) -> int:
    """Bytes a storage needs to hold a tensor with this layout (0 when it has no elements)."""
    if math.prod(size) == 0:
        return 0
    return (offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1) * itemsize


def check_layout(size: Any, stride: Any, offset: Any, dtype: torch.dtype,
                  storage_bytes: int, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    size = _check_ints(size, f"{what}: size")
    stride = _check_ints(stride, f"{what}: stride")
    if len(size) != len(stride) or not is_int(offset) or offset < 0:
        raise UnsafePayloadError(f"{what}: size {size}, stride {stride} and storage offset "
                                 f"{offset!r} do not describe a tensor")
    need = required_bytes(size, stride, offset, dtype.itemsize)
    if need > storage_bytes:
        raise UnsafePayloadError(
            f"{what}: a {dtype} tensor of size {list(size)}, stride {list(stride)} at offset "
            f"{offset} needs {need} bytes but its storage has only {storage_bytes}"
        )
    return size, stride


def shm_file_bytes(handle: bytes, what: str) -> int:
    """Data bytes of an existing torch shm file named `handle` (refuses other names)."""
    name = handle.decode("ascii", "replace")
    if not SHM_NAME.fullmatch(name):
        raise UnsafePayloadError(f"{what}: shared-memory name {name!r} is not one torch creates "
                                 "(/torch_<pid>_<random>_<counter>)")
    path = SHM_DIR + name   # the name is "/torch_...": no separator, no "..", checked above
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePayloadError(f"{what}: shared-memory file {name!r} does not exist "
                                 f"({exc.strerror}); was the sender's tensor freed?") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePayloadError(f"{what}: shared-memory {name!r} is not a regular file")
    return max(st.st_size - SHM_HEADER_BYTES, 0)


def check_manager_socket(manager: bytes) -> None:
    path = manager.decode("utf-8", "replace")
    if not _MANAGER_SOCKET.fullmatch(path) or os.path.normpath(path) != path or any(
        part in (".", "..") for part in path.split("/")
    ):
        raise UnsafePayloadError(f"shm manager socket {path!r} is not one torch creates "
                                 "(<tmp>/torch-shm-dir-XXXXXX/manager.sock)")
    try:
        is_socket = stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise UnsafePayloadError(f"shm manager socket {path!r} does not exist (is the sender's "
                                 "torch_shm_manager still running?)")
