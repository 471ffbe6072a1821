"""The restricted unpickler a tensor payload is read with: it executes nothing it does not know.

It is pickle's Python implementation, run opcode by opcode, after `check_opcodes` walked the
whole pickle without executing it (refusing the opcodes no tensor payload needs and malformed or
trailing data):

- globals resolve only through `GLOBALS`: our vetted reconstructors (tensor_handles.py,
  cuda_handles.py), class tokens that cannot be called, torch dtypes, and the SGLang names of
  sglang_types.py;
- REDUCE calls only those reconstructors; NEWOBJ + BUILD only fill plain-data records (pickled
  dataclasses such as SGLang's FlattenedTensorMetadata); SETITEM(S), APPEND(S) and ADDITEMS
  write only into plain dicts, lists and sets: nothing can write into a tensor or a class.

What it builds is descriptors only (checked by their reconstructors as they are built); the
reader in tensor_payload.py turns them into tensors. Every refusal is an `UnsafePayloadError`.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from typing import Any

import torch

from rollout_engine.protocol.bucket import FlattenedBucket, TensorMeta
from rollout_engine.protocol.cuda_handles import CUDA_RECONSTRUCTORS
from rollout_engine.protocol.payload_checks import UnsafePayloadError
from rollout_engine.protocol.sglang_types import SGLANG_GLOBALS
from rollout_engine.protocol.tensor_handles import (
    TORCH_RECONSTRUCTORS,
    ClassToken,
    Lazy,
    ReadContext,
    Reconstructor,
    Record,
)

__all__ = ["ALLOWED_GLOBALS", "GLOBALS", "RestrictedUnpickler", "check_opcodes", "describe"]


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


class RestrictedUnpickler(pickle._Unpickler):
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
            f"tensor payload uses pickle opcode {opcode} on {describe(target)}, which is not "
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


def describe(obj: Any) -> str:
    """How a refusal names `obj`: a reconstructor or class token by its qualified name, anything
    else by its type (never its value)."""
    if isinstance(obj, (ClassToken, Reconstructor)):
        return repr(obj)
    if isinstance(obj, Lazy):
        return f"a {type(obj).__name__}"
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__}"


def check_opcodes(data: bytes) -> None:
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
