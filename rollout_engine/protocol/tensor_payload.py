"""Tensor payloads: pickled tensor *handles*, base64 encoded (SGLang's update_weights_from_tensor).

    sender                                         receiver (another process, e.g. over HTTP)
    lend_named_tensors(obj) -> (base64 str, lease) deserialize_named_tensors(str) -> obj
      CPU tensor  -> moved to POSIX shm, lent by      shm_lease.open_lent maps the same shm
                     shm file name (shm_lease.py)
      CUDA tensor -> CUDA IPC handle                  rebuild_cuda_tensor opens the IPC handle

No tensor bytes travel in the string, so the receiver sees the sender's memory, not a copy.
No shared-memory reference travels either: the sender's `ShmLease` owns them until the call is
answered (`shm_lease.py`), so a refused, cancelled or failed call leaks nothing.

The receiver reads with a restricted unpickler (pickle's Python implementation, opcode by
opcode) that executes nothing it does not know:

- globals resolve only through `GLOBALS`: our vetted reconstructors (tensor_handles.py), class
  tokens that cannot be called, torch dtypes, and the SGLang names mapped in rollout_engine.compat;
- REDUCE calls only those reconstructors; NEWOBJ + BUILD only fill plain-data records (pickled
  dataclasses such as SGLang's FlattenedTensorMetadata); SETITEM(S), APPEND(S) and ADDITEMS
  write only into plain dicts, lists and sets: nothing can write into a tensor or a class;
- every storage is bounded: by the tensors declared on it, by the shm file it names (never
  grown), and by a per-payload byte cap; names and sockets must be of the forms torch creates.

Unpickling builds descriptors only; memory is mapped after every check passed, so a refused
payload maps and allocates nothing. Every refusal is a ValueError (HTTP 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import pickletools
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch
from torch.multiprocessing import reductions  # noqa: F401 - registers torch's reducers

from rollout_engine.protocol.bucket import FlattenedBucket, TensorMeta
from rollout_engine.protocol.cuda_handles import CUDA_RECONSTRUCTORS
from rollout_engine.protocol.payload_cache import ParsedPayloads, SentPayloads, recording
from rollout_engine.protocol.payload_checks import PayloadBudget, UnsafePayloadError
from rollout_engine.protocol.sglang_types import SGLANG_GLOBALS
from rollout_engine.protocol.shm_lease import ShmLease, lend_storage, rebuild_lent_storage
from rollout_engine.protocol.tensor_handles import (
    TORCH_RECONSTRUCTORS,
    ClassToken,
    CpuTensor,
    Lazy,
    OpenedShm,
    ReadContext,
    Reconstructor,
    Record,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "UnsafePayloadError",
    "deserialize_named_tensors",
    "drop_unread_references",
    "lend_named_tensors",
    "serialize_named_tensors",
]

DEFAULT_MAX_PAYLOAD_BYTES = 64 << 30
"""Storage bytes one payload may map when the caller gives no cap (the refit path passes one
derived from the model's size)."""

_PROTOCOL = 4


def _size(ctx: ReadContext, dims: Any) -> torch.Size:
    if not isinstance(dims, tuple) or len(dims) > 64 or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise UnsafePayloadError(f"torch.Size must hold at most 64 non-negative ints: {dims!r}")
    return torch.Size(dims)


def _ordered_dict(ctx: ReadContext, *args: Any) -> OrderedDict:
    if args:  # OrderedDict pickles as OrderedDict() followed by SETITEMS
        raise UnsafePayloadError("collections.OrderedDict must be built empty")
    return OrderedDict()


def _tensor_meta(ctx: ReadContext, *args: Any) -> TensorMeta:
    return TensorMeta(*args)  # plain data, validated in __post_init__


class _Bucket(Lazy):
    """FlattenedBucket(buffer, metas), built once its buffer is a tensor."""

    def __init__(self, buffer: Any, metas: Any) -> None:
        self.buffer, self.metas = buffer, metas

    def materialize(self, ctx, convert):
        return FlattenedBucket(convert(self.buffer), convert(self.metas))


def _bucket(ctx: ReadContext, *args: Any) -> _Bucket:
    if len(args) != 2:
        raise UnsafePayloadError(f"FlattenedBucket takes (buffer, metas), got {len(args)} args")
    return _Bucket(*args)


GLOBALS: dict[tuple[str, str], Any] = {
    **TORCH_RECONSTRUCTORS,
    **CUDA_RECONSTRUCTORS,
    ("torch", "Size"): Reconstructor("torch.Size", _size),
    ("collections", "OrderedDict"): Reconstructor("collections.OrderedDict", _ordered_dict),
    (TensorMeta.__module__, "TensorMeta"): Reconstructor("TensorMeta", _tensor_meta),
    (FlattenedBucket.__module__, "FlattenedBucket"): Reconstructor("FlattenedBucket", _bucket),
    **SGLANG_GLOBALS,
}
"""(module, name) -> what a payload gets for that global; torch dtypes are admitted too."""

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(GLOBALS)

_DTYPES = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}

# Never needed by a tensor payload; refused by a walk over the opcodes before anything runs.
_REFUSED_OPCODES = frozenset(
    {"INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER",
     "READONLY_BUFFER"}
)  # fmt: skip

_FD_HINT = (
    "; CPU tensors shared with torch's default 'file_descriptor' strategy can be opened only "
    "by the sender's own children: call torch.multiprocessing.set_sharing_strategy"
    "('file_system') in the trainer before serializing, or use serialize_named_tensors"
)


class _RestrictedUnpickler(pickle._Unpickler):
    """pickle's Python unpickler with every opcode that can call or mutate something vetted."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO, ctx: ReadContext) -> None:
        super().__init__(file, fix_imports=False)
        self.ctx = ctx

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in GLOBALS:
            return GLOBALS[module, name]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        hint = _FD_HINT if name == "rebuild_storage_fd" else (
            "; payloads may contain only tensors, containers, bucket metadata and the SGLang "
            "records in rollout_engine.compat")
        raise UnsafePayloadError(
            f"tensor payload refers to {module}.{name}, which is not allowed{hint}"
        )

    def _refuse(self, opcode: str, target: Any) -> None:
        raise UnsafePayloadError(
            f"tensor payload uses pickle opcode {opcode} on {_describe(target)}, which is not "
            "allowed (it could call or modify an object)"
        )

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(func, Reconstructor) or not isinstance(args, tuple):
            self._refuse("REDUCE", func)
        self.stack[-1] = func(self.ctx, args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and issubclass(cls, Record) and args == ()):
            self._refuse("NEWOBJ", cls)
        self.append(cls())

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if not isinstance(inst, Record):
            self._refuse("BUILD", inst)
        inst.fill(state)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._mapping("SETITEM")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._mapping("SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _mapping(self, opcode: str) -> dict:
        target = self.stack[-1]
        if type(target) not in (dict, OrderedDict):
            self._refuse(opcode, target)
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._list("APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._list("APPENDS").extend(items)

    def _list(self, opcode: str) -> list:
        if type(self.stack[-1]) is not list:
            self._refuse(opcode, self.stack[-1])
        return self.stack[-1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not set:
            self._refuse("ADDITEMS", self.stack[-1])
        self.stack[-1].update(items)

    def _load_refused(self) -> None:  # the opcode walk refuses these first
        raise UnsafePayloadError("tensor payload uses a refused pickle opcode")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.ADDITEMS[0]] = load_additems
    for _op in _REFUSED_OPCODES:
        dispatch[getattr(pickle, _op)[0]] = _load_refused
    del _op


def _describe(obj: Any) -> str:
    if isinstance(obj, (ClassToken, Reconstructor)):
        return repr(obj)
    if isinstance(obj, Lazy):
        return f"a {type(obj).__name__}"
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__}"


_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size, TensorMeta)


def _materialize(root: Any, ctx: ReadContext) -> Any:
    """Replace every descriptor in the unpickled tree by its value; keeps shared references."""
    memo: dict[int, Any] = {}
    if type(root) is list and all(type(x) is tuple and len(x) == 2 and type(x[0]) is str
                                  and type(x[1]) is CpuTensor for x in root):
        # what every refit sends (a list of (name, CPU tensor) pairs), without the walk
        out = []
        for name, lazy in root:
            t = memo.get(id(lazy))
            if t is None:
                t = memo[id(lazy)] = lazy.materialize(ctx, None)
            out.append((name, t))
        return out

    def convert(obj: Any) -> Any:
        if isinstance(obj, _ATOMS):
            return obj
        key = id(obj)
        if key in memo:
            return memo[key]
        kind = type(obj)
        if kind is list:
            out: Any = memo.setdefault(key, [])
            out.extend(convert(x) for x in obj)
        elif kind is tuple:
            out = memo.setdefault(key, tuple(convert(x) for x in obj))
        elif kind in (dict, OrderedDict):
            out = memo.setdefault(key, kind())
            for k, v in obj.items():
                out[convert(k)] = convert(v)
        elif kind in (set, frozenset):
            out = memo.setdefault(key, kind(convert(x) for x in obj))
        elif isinstance(obj, Lazy):
            out = memo.setdefault(key, obj.materialize(ctx, convert))
        else:
            raise UnsafePayloadError(f"tensor payload holds {_describe(obj)} as a value, "
                                     "which is not allowed")
        return out

    try:
        return convert(root)
    finally:
        # convert is in its own closure (a reference cycle, with ctx and memo): break it, so
        # the storages ctx opened are not held (mapped) until the next garbage collection
        memo.clear()
        convert = None  # type: ignore[assignment]  # noqa: F841


def _lend_storage(storage: torch.UntypedStorage):
    """A CPU storage as a lent handle: moved into POSIX shared memory in place (like
    `Tensor.share_memory_()`, torch's "file_system" strategy without changing the global
    strategy) and sent by a name any process on the host can open, unlike the
    "file_descriptor" strategy's fd. No shm reference is taken: the sender's lease holds the
    storage until the call is answered."""
    return (rebuild_lent_storage, lend_storage(storage))


def lend_named_tensors(payload: object) -> tuple[str, ShmLease]:
    """Pickle `payload` with tensors as handles and base64 encode it; the lease holds every
    CPU storage the string names. Release it once the receiver answered (any answer), failed
    or timed out: until then the handles can be opened even if the caller drops its tensors.

    `payload` is any nesting of list/tuple/dict/OrderedDict/str/int/float/bool/None/bytes,
    torch.Tensor (or Parameter), TensorMeta and FlattenedBucket; the receiver refuses anything
    else. CPU tensors are moved into shared memory *in place* and lent by file name; CUDA
    tensors are sent as CUDA IPC handles (receivable only by another process). The
    process-global sharing strategy is left untouched: this pickler overrides the storage
    reducer on its own dispatch table instead of calling `set_sharing_strategy("file_system")`.

    Do not modify the tensors until the receiver answered (CUDA IPC also requires the
    producer's memory to outlive every consumer). A string may be read any number of times,
    by any number of processes, while its storages live. A list of (name, tensor) pairs whose
    every view and storage were serialized before gives the same string again without
    pickling (`payload_cache.SentPayloads`).
    """
    key = SentPayloads.key(payload)
    if key is not None:
        cached = _SENT.get(key)
        if cached is not None:
            text, storages = cached
            return text, ShmLease(storages)
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, _PROTOCOL)
    shared: list[torch.UntypedStorage] = []
    pickler.dispatch_table[torch.UntypedStorage] = recording(_lend_storage, shared)
    pickler.dump(payload)
    text = base64.b64encode(buf.getvalue()).decode("ascii")
    if key is not None:
        _SENT.put(key, text, shared)
    return text, ShmLease(shared)


def serialize_named_tensors(payload: object) -> str:
    """`lend_named_tensors` without the lease: the caller keeps the tensors alive (and
    unmodified) until the receiver answered, which keeps their shm files named."""
    return lend_named_tensors(payload)[0]


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle without executing it: refuse unneeded opcodes, reject malformed data."""
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


def _decode(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data  # a raw pickle, as SGLang's MultiprocessingSerializer also accepts
    if not isinstance(data, str):
        raise ValueError(f"tensor payload must be a base64 str, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"tensor payload is not valid base64: {exc}") from exc


_PARSED = ParsedPayloads()
_SENT = SentPayloads()


def _read(data: Any, ctx: ReadContext) -> Any:
    raw = _decode(data)
    key = (raw, ctx.budget.max_bytes, ctx.tp_rank, ctx.depth)
    hit = _PARSED.get(key)
    storages = ctx.shm_storages if hit is None else hit[1]
    try:
        if hit is None:
            _check_opcodes(raw)
            tree = _RestrictedUnpickler(io.BytesIO(raw), ctx).load()
        else:
            tree = hit[0]
            for storage in storages:
                storage.check(ctx)
        out = _materialize(tree, ctx)
    except Exception as exc:
        if not ctx.restore_references:   # refused part way: what it did not open, dropped
            _drop_unopened(storages, ctx)
        if isinstance(exc, ValueError):  # UnsafePayloadError included
            raise
        raise ValueError(f"could not rebuild tensor payload: {type(exc).__name__}: {exc}") from exc
    if hit is None:
        _PARSED.put(key, tree, list(ctx.shm_storages))
    return out


def _drop_unopened(storages: list[Any], ctx: ReadContext) -> int:
    """Drop the reference a sender using torch's protocol took for this reader on each of
    `storages` the read did not open, by opening it as the read would have (the mapping is
    closed as soon as it is let go). Lent storages carry none. Returns how many."""
    dropped = 0
    for storage in storages:
        if storage.lent or ctx.was_opened(storage):
            continue
        try:
            storage.open()
        except Exception:  # noqa: BLE001 - gone already (the sender died): nothing to drop
            continue
        dropped += 1
    return dropped


def drop_unread_references(data: Any, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                           tp_rank: int = 0) -> int:
    """A payload its receiver refuses without reading it (the engine asleep, a flag refused):
    drop the shm references a sender using torch's protocol took for it, as reading it would
    have; lent handles carry none, so our own payloads need nothing. Only handles the
    restricted reader admits are opened (those it parsed before a refusal included); a payload
    that cannot be decoded names none. Nested payloads (a rank's value) are not reached.
    Returns how many references were dropped."""
    try:
        raw = _decode(data)
    except ValueError:
        return 0
    ctx = ReadContext(PayloadBudget(max_bytes), tp_rank, 0, _read)
    hit = _PARSED.get((raw, max_bytes, tp_rank, 0))
    if hit is not None:
        return _drop_unopened(hit[1], ctx)
    try:
        _check_opcodes(raw)
        _RestrictedUnpickler(io.BytesIO(raw), ctx).load()
    except Exception:  # noqa: BLE001 - what was admitted before the refusal is still dropped
        pass
    return _drop_unopened(ctx.shm_storages, ctx)


def deserialize_named_tensors(data: str | bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                              tp_rank: int = 0, read_by_others: bool = False,
                              opened: Optional[list[OpenedShm]] = None) -> object:
    """Decode a tensor payload string (ours, or one SGLang's trainers build), rebuilding tensors
    from their handles.

    `data`: base64 text (or the raw pickle bytes). `max_bytes` caps the storage bytes the
    payload, nested payloads included, may map. `tp_rank` picks the rank's entry of an SGLang
    `LocalSerializedTensor`. `read_by_others`: this very string is also read by another
    process (one payload for every rank of a tensor-parallel engine), which drops the one shm
    reference a sender using torch's protocol took for each storage; this reader gives back
    the one it drops, so the sender's file is not unlinked under it once the ranks unmap.
    Lent storages (our sender's) carry no reference: any number of readers just map them.
    A read refused part way drops the references of what it did not open (unless
    `read_by_others`), so a refusal leaks none.

    Raises UnsafePayloadError (a ValueError) for any global, opcode or handle outside the
    rules in the module docstring, before anything is mapped or executed. Malformed base64,
    truncated pickles and handles that cannot be opened raise ValueError.

    `rebuild_storage_fd` is refused: its argument is a multiprocessing `DupFd` that, when
    unpickled, connects to the sender's resource-sharer socket; that only works for the
    sender's own children, is meaningless for a process reached over HTTP, and admitting it
    would let a payload make this process open connections. Our sender never emits it.

    `opened`: a list that receives an `OpenedShm` for every shared-memory storage the read
    opened, once per open, nested payloads included.
    """
    if not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"tp_rank: must be a non-negative int, got {tp_rank!r}")
    return _read(data, ReadContext(PayloadBudget(max_bytes), tp_rank, 0, _read,
                                   restore_references=read_by_others, opened_log=opened))
