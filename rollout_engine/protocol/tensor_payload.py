"""Tensor payloads: pickled tensor *handles*, base64 encoded (SGLang's update_weights_from_tensor).

    sender (payload_sender.py)                     receiver (this module; another process)
    lend_named_tensors(obj) -> (base64 str, lease) deserialize_named_tensors(str) -> obj
      CPU tensor  -> moved to POSIX shm, lent by      shm_lease.open_lent maps the same shm
                     shm file name (shm_lease.py)
      CUDA tensor -> CUDA IPC handle                  rebuild_cuda_tensor opens the IPC handle

No tensor bytes travel in the string, so the receiver sees the sender's memory, not a copy.
No shared-memory reference travels either: the sender's `ShmLease` owns them until the call is
answered (`shm_lease.py`), so a refused, cancelled or failed call leaks nothing. The sender's
`lend_named_tensors` and `serialize_named_tensors` are importable from here too: with the
receiver's functions they are the payload's public API (docs/API.md).

The receiver reads in two steps:

- unpickle with the restricted unpickler (restricted_unpickler.py), which executes nothing it
  does not know and builds descriptors only, each checked as it is built: every storage is
  bounded by the tensors declared on it, by the shm file it names (never grown), and by a
  per-payload byte cap; names and sockets must be of the forms torch creates;
- materialize: the descriptors become tensors, each storage opened once.

Memory is mapped after every check passed, so a refused payload maps and allocates nothing.
Every refusal is a ValueError (HTTP 400). A repeat of a string already read reuses its parse
(`payload_cache.ParsedPayloads`), its storages checked again.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections import OrderedDict
from typing import Any, Optional

import torch

from rollout_engine.protocol.bucket import TensorMeta
from rollout_engine.protocol.payload_cache import ParsedPayloads
from rollout_engine.protocol.payload_checks import PayloadBudget, UnsafePayloadError
from rollout_engine.protocol.payload_sender import (  # public here too: docs/API.md
    lend_named_tensors,
    serialize_named_tensors,
)
from rollout_engine.protocol.restricted_unpickler import (
    RestrictedUnpickler,
    check_opcodes,
    describe,
)
from rollout_engine.protocol.tensor_handles import CpuTensor, Lazy, OpenedShm, ReadContext

__all__ = [
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
            raise UnsafePayloadError(f"tensor payload holds {describe(obj)} as a value, "
                                     "which is not allowed")
        return out

    try:
        return convert(root)
    finally:
        # convert is in its own closure (a reference cycle, with ctx and memo): break it, so
        # the storages ctx opened are not held (mapped) until the next garbage collection
        memo.clear()
        convert = None  # type: ignore[assignment]  # noqa: F841


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


def _read(data: Any, ctx: ReadContext) -> Any:
    raw = _decode(data)
    key = (raw, ctx.budget.max_bytes, ctx.tp_rank, ctx.depth)
    hit = _PARSED.get(key)
    storages = ctx.shm_storages if hit is None else hit[1]
    try:
        if hit is None:
            check_opcodes(raw)
            tree = RestrictedUnpickler(io.BytesIO(raw), ctx).load()
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
        check_opcodes(raw)
        RestrictedUnpickler(io.BytesIO(raw), ctx).load()
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
    rules of restricted_unpickler.py and tensor_handles.py, before anything is mapped or executed. Malformed base64,
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
