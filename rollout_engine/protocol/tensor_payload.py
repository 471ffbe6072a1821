"""Tensor payloads: pickled tensor *handles*, base64 encoded (SGLang's update_weights_from_tensor).

    sender                                         receiver (another process, e.g. over HTTP)
    serialize_named_tensors(obj) -> base64 str ->  deserialize_named_tensors(str) -> obj
      CPU tensor  -> moved to POSIX shm, sent as      rebuild_storage_filename maps the same shm
                     (manager socket, shm file name)
      CUDA tensor -> CUDA IPC handle                  rebuild_cuda_tensor opens the IPC handle

No tensor bytes travel in the string, so the receiver sees the sender's memory, not a copy.
The receiver uses a restricted unpickler: it admits only the globals in `ALLOWED_GLOBALS` (plus
torch dtypes) and refuses opcodes that could mutate objects, so a payload cannot run code.
It does not make a hostile *handle* harmless (a bad shm name or size can still fail or crash
on access), so the endpoint must only be reachable by the trainer.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import pickletools
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reducers

from rollout_engine.protocol.bucket import FlattenedBucket, TensorMeta

__all__ = [
    "ALLOWED_GLOBALS",
    "UnsafePayloadError",
    "deserialize_named_tensors",
    "serialize_named_tensors",
]

_REDUCTIONS = "torch.multiprocessing.reductions"

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # CPU tensor: rebuild_tensor(Tensor|Parameter,
        #     rebuild_typed_storage(rebuild_storage_filename(UntypedStorage, manager, name, size),
        #                           dtype), (storage_offset, Size, stride, requires_grad))
        (_REDUCTIONS, "rebuild_tensor"),
        (_REDUCTIONS, "rebuild_typed_storage"),
        (_REDUCTIONS, "rebuild_storage_filename"),
        ("torch.storage", "UntypedStorage"),
        # CUDA tensor: rebuild_cuda_tensor(Tensor|Parameter, Size, stride, offset, TypedStorage,
        #     dtype, device index, IPC handle, sizes, requires_grad, ref-counter and event handles)
        (_REDUCTIONS, "rebuild_cuda_tensor"),
        ("torch.storage", "TypedStorage"),
        # Shared by both.
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        # Containers and bucket metadata.
        ("collections", "OrderedDict"),
        (TensorMeta.__module__, "TensorMeta"),
        (FlattenedBucket.__module__, "FlattenedBucket"),
    }
)
"""Exactly the (module, name) globals ForkingPickler emits for our payloads (torch 2.13).

Deliberately absent: `rebuild_storage_fd` (see `deserialize_named_tensors`),
`rebuild_storage_empty` (the file_system path shares empty storages too), and
`torch._utils._rebuild_tensor_v2` (emitted only by plain pickle/torch.save, whose storages
travel as torch.load bytes). torch dtypes (`torch.float32`, ...) are admitted by `_DTYPE_NAMES`.
"""

_DTYPE_NAMES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))

# BUILD would let a payload setattr on an admitted class (e.g. torch.Tensor); the others create
# or look up objects without going through find_class. None of them occur in our payloads.
_REFUSED_OPCODES = frozenset(
    {"BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID",
     "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"}
)  # fmt: skip

_PROTOCOL = 4


class UnsafePayloadError(ValueError):
    """A tensor payload referred to a global, or used an opcode, that is not allowed."""


def _reduce_storage_by_filename(storage: torch.UntypedStorage):
    """torch's `reduce_storage`, "file_system" branch, without the global sharing strategy.

    Moves the storage into POSIX shared memory in place (like `Tensor.share_memory_()`) and
    returns (rebuild_storage_filename, (cls, manager socket, shm name, size)): a name that any
    process on the host can open, unlike the "file_descriptor" strategy's fd.
    """
    if storage.device.type != "cpu":
        raise ValueError(f"cannot send a bare {storage.device} storage; send a tensor instead")
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()  # released by the receiver's rebuild_storage_filename
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), *metadata))


def serialize_named_tensors(payload: object) -> str:
    """Pickle `payload` with tensors as handles and base64 encode it.

    `payload` is any nesting of list/tuple/dict/OrderedDict/str/int/float/bool/None/bytes,
    torch.Tensor (or Parameter), TensorMeta and FlattenedBucket; the receiver refuses anything
    else. CPU tensors are moved into shared memory *in place* and sent by file name; CUDA tensors
    are sent as CUDA IPC handles (receivable only by another process).

    The process-global sharing strategy is left untouched: this pickler overrides the storage
    reducer on its own dispatch table instead of calling `set_sharing_strategy("file_system")`.

    Lifetime: keep the tensors alive, and do not modify them, until the receiver has rebuilt
    them and reported back (CUDA IPC requires the producer's memory to outlive every consumer).
    Deserialize each string once: each CPU handle carries one shm reference for its receiver.
    """
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, _PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_filename
    pickler.dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED_GLOBALS` and torch dtypes; everything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise UnsafePayloadError(
            f"tensor payload refers to {module}.{name}, which is not allowed; payloads may "
            "contain only tensors, containers, TensorMeta and FlattenedBucket"
        )


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle without executing it: refuse mutating opcodes, reject malformed data."""
    stop_pos = None
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name in _REFUSED_OPCODES:
                raise UnsafePayloadError(
                    f"tensor payload uses pickle opcode {opcode.name} at byte {pos}, "
                    "which is not allowed"
                )
            stop_pos = pos
    except UnsafePayloadError:
        raise
    except Exception as exc:  # genops raises ValueError, but be strict about anything
        raise ValueError(f"malformed tensor payload (truncated or not a pickle): {exc}") from exc
    if stop_pos != len(data) - 1:
        raise ValueError(f"malformed tensor payload: {len(data) - 1 - stop_pos} trailing bytes")


def deserialize_named_tensors(data: str) -> object:
    """Decode a `serialize_named_tensors` string, rebuilding tensors from their handles.

    Raises UnsafePayloadError (a ValueError) if the pickle names any global outside
    `ALLOWED_GLOBALS`/torch dtypes or uses a refused opcode; nothing is executed in that case,
    since the opcode walk runs first and find_class refuses before any call. Malformed base64,
    truncated pickles and handles that cannot be opened raise ValueError.

    `rebuild_storage_fd` is refused: its argument is a multiprocessing `DupFd` that, when
    unpickled, connects to the sender's resource-sharer socket; that only works for the
    sender's own children, is meaningless for a process reached over HTTP, and admitting it
    would let a payload make this process open connections. Our sender never emits it.
    """
    if not isinstance(data, str):
        raise ValueError(f"tensor payload must be a base64 str, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"tensor payload is not valid base64: {exc}") from exc
    _check_opcodes(raw)
    try:
        return _RestrictedUnpickler(io.BytesIO(raw), fix_imports=False).load()
    except UnsafePayloadError:
        raise
    except Exception as exc:
        raise ValueError(f"could not rebuild tensor payload: {type(exc).__name__}: {exc}") from exc
