"""Vetted reconstructors for the tensor handles inside a payload: descriptors first, memory later.

Reading a payload happens in two steps, so a bad handle is refused before anything is mapped:

    unpickle  -> descriptors only (ShmStorage, CpuTensor; CudaTensor in cuda_handles.py), each
                 checked as it is built:
                 names and sockets of the form torch creates, shm files that exist and are big
                 enough (opening a short one would grow it), tensors inside their storage,
                 every storage charged against one byte budget per payload
    materialize -> torch opens the vetted handles (rebuild_storage_filename, rebuild_cuda_tensor)

The checks themselves, and the forms of name and socket admitted (the ones torch creates), are
in payload_checks.py.

A shm storage comes in two forms. A lent one (`shm_lease.rebuild_lent_storage`, what our
sender emits) is mapped here directly: no reference of the sender's is dropped and nothing
connects to the sender's torch_shm_manager (the sender's lease owns the file). One pickled by
torch's own reducer (`rebuild_storage_filename`, e.g. SGLang's serializer) carries a reference
taken for this reader, dropped when torch opens it.

A payload can only *name* classes (UntypedStorage, Tensor, ...): they arrive as `ClassToken`s,
which cannot be called, so `UntypedStorage(1 << 40)` is refused rather than allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from torch.multiprocessing import reductions

from rollout_engine.protocol.payload_checks import (
    PayloadBudget,
    UnsafePayloadError,
    as_bytes,
    check_dtype,
    check_layout,
    check_manager_socket,
    is_int,
    required_bytes,
    shm_file_bytes,
)
from rollout_engine.protocol.shm_lease import (
    LENT_STORAGE_GLOBAL,
    SHM_DIR,
    SHM_HEADER_BYTES,
    open_lent,
)

__all__ = [
    "ClassToken",
    "Lazy",
    "OpenedShm",
    "ReadContext",
    "Reconstructor",
    "Record",
    "TORCH_RECONSTRUCTORS",
    "storage_token",
    "tensor_token",
]


class OpenedShm(NamedTuple):
    """One shm storage a read opened: its file (path, header + data bytes), and whether it was
    lent (the sender kept every reference) or carried a reference the open dropped."""

    storage: torch.UntypedStorage
    path: str
    file_bytes: int
    lent: bool


class ReadContext:
    """What reconstructors and records see while one payload is read."""

    def __init__(self, budget: PayloadBudget, tp_rank: int, depth: int,
                 read_nested: Callable[[Any, ReadContext], Any],
                 restore_references: bool = False,
                 opened_log: Optional[list[OpenedShm]] = None) -> None:
        self.budget = budget
        self.tp_rank = tp_rank
        self.depth = depth
        self._read_nested = read_nested
        # one payload read by several processes (every rank of a tensor-parallel engine):
        # a sender using torch's protocol took one reference per storage, for one reader; the
        # others give back the one their open drops (lent storages carry none)
        self.restore_references = restore_references
        self.shm_storages: list[ShmStorage] = []   # every shm storage the payload names
        self.managers_checked: set[bytes] = set()
        self._opened: dict[int, torch.UntypedStorage] = {}
        # every shm storage opened, nested reads too
        self.opened_log = opened_log

    def open_once(self, storage: ShmStorage | EmptyStorage) -> torch.UntypedStorage:
        """`storage.open()`, once per storage per read however many tensors view it: a sender
        using torch's protocol took one shm reference per storage it pickled, and each open
        drops one (two views of one storage opened twice would unlink the file under the live
        sender)."""
        opened = self._opened.get(id(storage))
        if opened is None:
            opened = self._opened[id(storage)] = storage.open()
            if not isinstance(storage, ShmStorage):
                return opened
            if self.restore_references and not storage.lent:
                opened._shared_incref()
            if self.opened_log is not None:
                self.opened_log.append(OpenedShm(opened, SHM_DIR + storage.handle.decode(),
                                                 SHM_HEADER_BYTES + storage.num_bytes,
                                                 storage.lent))
        return opened

    def was_opened(self, storage: ShmStorage | EmptyStorage) -> bool:
        return id(storage) in self._opened

    def read_nested(self, data: Any) -> Any:
        """Read a payload embedded in this one, with the same restrictions and byte budget.
        Its references are always dropped: a nested payload (a rank's value) is its reader's
        own pickle, whoever else reads the outer payload."""
        if self.depth >= 1:
            raise UnsafePayloadError("tensor payload nests serialized payloads more than once")
        return self._read_nested(data, ReadContext(self.budget, self.tp_rank, self.depth + 1,
                                                   self._read_nested,
                                                   opened_log=self.opened_log))


class Lazy:
    """Something unpickling built that becomes a value only in `materialize`."""

    def materialize(self, ctx: ReadContext, convert: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM is refused before this
        raise UnsafePayloadError(f"tensor payload writes into a {type(self).__name__}")


class ClassToken:
    """A class a payload names as an argument (e.g. `cls` of rebuild_tensor); never callable."""

    def __init__(self, qualname: str, cls: type) -> None:
        self.qualname, self.cls = qualname, cls

    def __repr__(self) -> str:
        return self.qualname


class Reconstructor:
    """A function a payload may call (REDUCE): checks its arguments, returns a value or Lazy."""

    def __init__(self, qualname: str, build: Callable[..., Any]) -> None:
        self.qualname, self.build = qualname, build

    def __call__(self, ctx: ReadContext, args: tuple) -> Any:
        return self.build(ctx, *args)

    def __repr__(self) -> str:
        return self.qualname


class Record(Lazy):
    """A plain-data object a payload builds as a pickled dataclass does (NEWOBJ, then BUILD
    with a dict of exactly `FIELDS`). Subclasses check the fields in `check`."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    QUALNAME: ClassVar[str] = ""

    def __init__(self) -> None:
        self.state: Optional[dict[str, Any]] = None

    def fill(self, state: Any) -> None:
        if self.state is not None:
            raise UnsafePayloadError(f"tensor payload sets the state of {self.QUALNAME} twice")
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]  # (dict, slotstate) form
        if not isinstance(state, dict) or set(state) != set(self.FIELDS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise UnsafePayloadError(
                f"{self.QUALNAME} must have exactly the fields {list(self.FIELDS)}, got {got}"
            )
        self.check(state)
        self.state = dict(state)

    def check(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def filled(self) -> dict[str, Any]:
        if self.state is None:
            raise UnsafePayloadError(f"tensor payload leaves a {self.QUALNAME} without state")
        return self.state


# ---- descriptors -----------------------------------------------------------------------------


class ShmStorage(Lazy):
    """A CPU storage in POSIX shared memory, vetted: lent (`shm_lease`; `manager` None) or
    pickled by torch (`rebuild_storage_filename`'s arguments)."""

    def __init__(self, manager: Optional[bytes], handle: bytes, num_bytes: int) -> None:
        self.manager, self.handle, self.num_bytes = manager, handle, num_bytes

    @property
    def lent(self) -> bool:
        return self.manager is None

    def check(self, ctx: ReadContext) -> None:
        """What must hold each time the storage is opened: within the payload's byte budget,
        the sender's manager socket there (torch's form), the shm file at least this long
        (mapping past its end would grow it, or fault on access)."""
        what = "rebuild_lent_storage" if self.lent else "rebuild_storage_filename"
        ctx.budget.charge(("shm", self.handle), self.num_bytes,
                          lambda: f"shared memory {self.handle!r}")
        if self.manager is not None and self.manager not in ctx.managers_checked:
            check_manager_socket(self.manager)   # one sender: one socket for all
            ctx.managers_checked.add(self.manager)
        available = shm_file_bytes(self.handle, what)
        if self.num_bytes > available:
            raise UnsafePayloadError(
                f"{what}: storage claims {self.num_bytes} bytes but shared memory "
                f"{self.handle.decode()!r} holds {available}; opening it would grow it"
            )

    def materialize(self, ctx, convert):
        raise UnsafePayloadError("tensor payload holds a bare storage; send tensors")

    def open(self) -> torch.UntypedStorage:
        if self.manager is None:
            return open_lent(self.handle, self.num_bytes)
        return reductions.rebuild_storage_filename(torch.UntypedStorage, self.manager,
                                                   self.handle, self.num_bytes)


class EmptyStorage(Lazy):
    """`rebuild_storage_empty`: a zero-byte CPU storage."""

    num_bytes = 0

    def materialize(self, ctx, convert):
        raise UnsafePayloadError("tensor payload holds a bare storage; send tensors")

    def open(self) -> torch.UntypedStorage:
        return torch.UntypedStorage(0)


class TypedStorage(Lazy):
    """`rebuild_typed_storage(storage, dtype)`."""

    def __init__(self, storage: ShmStorage | EmptyStorage, dtype: torch.dtype) -> None:
        self.storage, self.dtype = storage, dtype

    def materialize(self, ctx, convert):
        raise UnsafePayloadError("tensor payload holds a bare storage; send tensors")


def _finish(t: torch.Tensor, cls: ClassToken, requires_grad: bool) -> torch.Tensor:
    if cls.cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t


class CpuTensor(Lazy):
    """`rebuild_tensor(cls, typed_storage, (offset, size, stride, requires_grad))`, in bounds."""

    def __init__(self, cls: ClassToken, storage: TypedStorage, offset: int,
                 size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool) -> None:
        self.cls, self.storage, self.offset = cls, storage, offset
        self.size, self.stride, self.requires_grad = size, stride, requires_grad

    def materialize(self, ctx, convert):
        untyped = ctx.open_once(self.storage.storage)
        dtype = self.storage.dtype
        # in-process, torch returns the sender's own storage from its cache: check it again
        if required_bytes(self.size, self.stride, self.offset, dtype.itemsize) > untyped.nbytes():
            raise UnsafePayloadError("tensor payload: shared storage is smaller than declared")
        # what torch._utils._rebuild_tensor does, without a TypedStorage wrapper in between
        t = torch.empty((0,), dtype=dtype).set_(untyped, self.offset, self.size, self.stride)
        return _finish(t, self.cls, self.requires_grad)


# ---- reconstructors --------------------------------------------------------------------------


def storage_token(cls: Any, what: str) -> None:
    if not (isinstance(cls, ClassToken) and cls.cls in (torch.UntypedStorage,
                                                        torch.storage.TypedStorage)):
        raise UnsafePayloadError(f"{what}: storage class must be torch's storage, got {cls!r}")


def tensor_token(cls: Any, what: str) -> ClassToken:
    if not (isinstance(cls, ClassToken) and cls.cls in (torch.Tensor, torch.nn.Parameter)):
        raise UnsafePayloadError(f"{what}: tensor class must be Tensor or Parameter, got {cls!r}")
    return cls


def _rebuild_storage_filename(ctx: ReadContext, cls: Any, manager: Any, handle: Any,
                              size: Any, dtype: Any = None) -> ShmStorage:
    what = "rebuild_storage_filename"
    storage_token(cls, what)
    manager, handle = as_bytes(manager, f"{what}: manager"), as_bytes(handle, f"{what}: name")
    itemsize = 1 if dtype is None else check_dtype(dtype, what).itemsize
    if not is_int(size) or size < 0:
        raise UnsafePayloadError(f"{what}: size must be a non-negative int, got {size!r}")
    storage = ShmStorage(manager, handle, size * itemsize)
    storage.check(ctx)
    ctx.shm_storages.append(storage)
    return storage if dtype is None else TypedStorage(storage, dtype)  # type: ignore[return-value]


def _rebuild_lent_storage(ctx: ReadContext, handle: Any, size: Any) -> ShmStorage:
    what = "rebuild_lent_storage"
    handle = as_bytes(handle, f"{what}: name")
    if not is_int(size) or size < 0:
        raise UnsafePayloadError(f"{what}: size must be a non-negative int, got {size!r}")
    storage = ShmStorage(None, handle, size)
    storage.check(ctx)
    ctx.shm_storages.append(storage)
    return storage


def _rebuild_storage_empty(ctx: ReadContext, cls: Any) -> EmptyStorage:
    storage_token(cls, "rebuild_storage_empty")
    return EmptyStorage()


def _rebuild_typed_storage(ctx: ReadContext, storage: Any, dtype: Any) -> TypedStorage:
    if not isinstance(storage, (ShmStorage, EmptyStorage)):
        raise UnsafePayloadError(f"rebuild_typed_storage: expected a shared storage, got "
                                 f"{type(storage).__name__}")
    return TypedStorage(storage, check_dtype(dtype, "rebuild_typed_storage"))


def _rebuild_tensor(ctx: ReadContext, cls: Any, storage: Any, metadata: Any) -> CpuTensor:
    what = "rebuild_tensor"
    cls = tensor_token(cls, what)
    if not isinstance(storage, TypedStorage):
        raise UnsafePayloadError(f"{what}: expected a typed shared storage, got "
                                 f"{type(storage).__name__}")
    if not (isinstance(metadata, tuple) and len(metadata) == 4
            and isinstance(metadata[3], bool)):
        raise UnsafePayloadError(f"{what}: metadata must be (offset, size, stride, "
                                 f"requires_grad), got {metadata!r}")
    offset, size, stride, requires_grad = metadata
    size, stride = check_layout(size, stride, offset, storage.dtype,
                                 storage.storage.num_bytes, what)
    return CpuTensor(cls, storage, offset, size, stride, requires_grad)


_R = "torch.multiprocessing.reductions"

TORCH_RECONSTRUCTORS: dict[tuple[str, str], Any] = {
    (_R, "rebuild_storage_filename"): Reconstructor(f"{_R}.rebuild_storage_filename",
                                                    _rebuild_storage_filename),
    LENT_STORAGE_GLOBAL: Reconstructor(".".join(LENT_STORAGE_GLOBAL), _rebuild_lent_storage),
    (_R, "rebuild_storage_empty"): Reconstructor(f"{_R}.rebuild_storage_empty",
                                                 _rebuild_storage_empty),
    (_R, "rebuild_typed_storage"): Reconstructor(f"{_R}.rebuild_typed_storage",
                                                 _rebuild_typed_storage),
    (_R, "rebuild_tensor"): Reconstructor(f"{_R}.rebuild_tensor", _rebuild_tensor),
    ("torch.storage", "UntypedStorage"): ClassToken("torch.storage.UntypedStorage",
                                                    torch.UntypedStorage),
    ("torch", "UntypedStorage"): ClassToken("torch.UntypedStorage", torch.UntypedStorage),
    ("torch.storage", "TypedStorage"): ClassToken("torch.storage.TypedStorage",
                                                  torch.storage.TypedStorage),
    ("torch", "Tensor"): ClassToken("torch.Tensor", torch.Tensor),
    ("torch._tensor", "Tensor"): ClassToken("torch._tensor.Tensor", torch.Tensor),
    ("torch.nn.parameter", "Parameter"): ClassToken("torch.nn.parameter.Parameter",
                                                    torch.nn.Parameter),
}
"""What ForkingPickler emits for CPU tensors ("file_system" sharing), and our lent handles;
CUDA: cuda_handles.py."""
