"""SGLang's refit payloads -> (name, tensor) pairs, and the byte cap the refit path reads with.

Formats read (besides our own list of pairs / FlattenedBucket, handled in weights/refit.py):

    load_format=None | "direct"
        [(name, Tensor)]                              SGLang's plain MultiprocessingSerializer
        [(name, LocalSerializedTensor(values=[...]))] verl (sglang weight_sync.update_weights):
                                                      values[tp_rank] is resolved to a tensor
                                                      while the payload is read
    load_format="flattened_bucket"
        {"flattened_tensor": T, "metadata": [FlattenedTensorMetadata, ...]}    slime
        (or a list of such dicts; metadata entries may also be plain dicts)

An SGLang bucket is packed back to back. Each entry covers T[start_idx:end_idx], counted in
T's elements, with numel == end_idx - start_idx:

    T uint8, dtype != uint8   bytes, reinterpreted as dtype (SGLang >= multi-dtype buckets);
                              numel == prod(shape) * itemsize
    T.dtype == dtype          elements; numel == prod(shape)
    T another dtype           elements cast to dtype (older SGLang, one dtype per bucket)

A tensor packed after an odd number of bytes is copied to an aligned buffer before the
reinterpretation (torch cannot view misaligned bytes); our aligned layout never needs it.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any, Optional

import torch
from torch import nn

from rollout_engine.protocol.sglang_types import SglangTensorMetadata
from rollout_engine.protocol.tensor_handles import OpenedShm
from rollout_engine.protocol.tensor_payload import deserialize_named_tensors

__all__ = [
    "named_tensors_from_sglang",
    "read_refit_payload",
    "refit_payload_cap",
    "unpack_sglang_bucket",
]

_BUCKET_KEYS = frozenset({"flattened_tensor", "metadata"})


def refit_payload_cap(model: nn.Module) -> int:
    """Storage bytes one refit payload may map: 4x the model's weights, plus 64 MiB.

    Room for a float32 trainer refitting a bfloat16 engine (twice the bytes) and for storages
    shared whole under smaller views (a slice of a fused parameter sends its whole storage)."""
    cap = _CAPS.get(model)
    if cap is None:   # shapes never change: computed once per model, not once per call
        weight_bytes = sum(t.numel() * t.element_size()
                           for t in itertools.chain(model.parameters(), model.buffers()))
        cap = _CAPS[model] = 4 * weight_bytes + (64 << 20)
    return cap


_CAPS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def read_refit_payload(data: Any, model: nn.Module, tp_rank: int = 0,
                       read_by_others: bool = False,
                       opened: Optional[list[OpenedShm]] = None) -> Any:
    """One rank's `serialized_named_tensors` entry, read with the model's byte cap
    (`read_by_others`: the same string is every rank's, and another rank drops the sender's
    references; `opened` receives the shm storages opened: `deserialize_named_tensors`)."""
    return deserialize_named_tensors(data, max_bytes=refit_payload_cap(model), tp_rank=tp_rank,
                                     read_by_others=read_by_others, opened=opened)


def _is_sglang_bucket(obj: Any) -> bool:
    return isinstance(obj, dict) and set(obj) == _BUCKET_KEYS


def _metadata(entry: Any) -> SglangTensorMetadata:
    if isinstance(entry, SglangTensorMetadata):
        return entry
    if isinstance(entry, dict) and set(entry) == set(SglangTensorMetadata.__dataclass_fields__):
        return SglangTensorMetadata.from_fields(entry)
    raise ValueError("flattened bucket metadata entries must be FlattenedTensorMetadata (name, "
                     f"shape, dtype, start_idx, end_idx, numel), got {type(entry).__name__}")


def unpack_sglang_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views (copies only for misaligned bytes or a dtype cast) of an SGLang flattened bucket."""
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.is_contiguous()):
        raise ValueError("flattened_tensor must be a 1-D contiguous tensor, got "
                         f"{type(flat).__name__} {getattr(flat, 'shape', '')}")
    if not isinstance(metadata, (list, tuple)):
        raise ValueError(f"metadata must be a list, got {type(metadata).__name__}")
    out = []
    for meta in map(_metadata, metadata):
        if meta.end_idx > flat.numel():
            raise ValueError(f"tensor {meta.name!r}: [{meta.start_idx}, {meta.end_idx}) is past "
                             f"the end of the flattened tensor ({flat.numel()} elements)")
        piece = flat[meta.start_idx:meta.end_idx]
        count = math.prod(meta.shape)
        if flat.dtype == torch.uint8 and meta.dtype != torch.uint8:
            itemsize = meta.dtype.itemsize
            if meta.numel != count * itemsize:
                raise ValueError(f"tensor {meta.name!r}: {meta.numel} bytes, but shape "
                                 f"{list(meta.shape)} of {meta.dtype} needs {count * itemsize}")
            if piece.storage_offset() % itemsize:
                piece = piece.clone()  # back-to-back packing put it at a misaligned byte
            tensor = piece.view(meta.dtype).view(meta.shape)
        else:
            if meta.numel != count:
                raise ValueError(f"tensor {meta.name!r}: {meta.numel} elements, but shape "
                                 f"{list(meta.shape)} needs {count}")
            tensor = piece.view(meta.shape)
            if tensor.dtype != meta.dtype:
                tensor = tensor.to(meta.dtype)
        out.append((meta.name, tensor))
    return out


def named_tensors_from_sglang(payload: Any, load_format: Optional[str]
                              ) -> Optional[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs of an SGLang flattened-bucket payload; None for any other payload
    (lists of pairs, verl's included once read, are already in our own format)."""
    if load_format != "flattened_bucket":
        return None
    if _is_sglang_bucket(payload):
        return unpack_sglang_bucket(payload)
    if isinstance(payload, list) and payload and all(map(_is_sglang_bucket, payload)):
        return [pair for bucket in payload for pair in unpack_sglang_bucket(bucket)]
    return None
