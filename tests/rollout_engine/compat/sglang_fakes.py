"""The trainer side, reimplemented from reading SGLang, slime and verl (nothing imported).

SGLang's classes are recreated under SGLang's module paths, registered in `sys.modules` only
while payloads are pickled (`sglang_modules()`): pickle names a class by its defining module,
so these payloads are byte for byte what the real classes produce. The engine never sees the
fake modules: they are removed before anything is read.

    MultiprocessingSerializer.serialize   sglang/srt/utils: ForkingPickler(buf).dump(obj),
                                          base64 when output_str=True
    FlattenedTensorBucket                 sglang/srt/weight_sync/tensor_bucket.py: tensors
                                          flattened back to back; newer: viewed as uint8
                                          (indices in bytes), older: one dtype per bucket
                                          (indices in elements)
    slime                                 update_weight_from_tensor.py: one base64 string per
                                          rank of {"flattened_tensor", "metadata"},
                                          load_format="flattened_bucket"
    verl (sglang weight_sync.update_weights)   [(name, LocalSerializedTensor(values=[raw
                                          pickle per TP rank]))] serialized raw, then base64
                                          by verl's HTTP adapter, load_format=None

Module paths are those of SGLang 0.5.23's sources: LocalSerializedTensor is defined in
model_executor/model_runner_components/weight_updater.py (since 0.5.16; verl 0.9.1 imports it
from there, falling back to model_runner before that), FlattenedTensorMetadata and
FlattenedTensorBucket in weight_sync/tensor_bucket.py.
"""

from __future__ import annotations

import base64
import contextlib
import io
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"   # LocalSerializedTensor before 0.5.16
WEIGHT_UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"
SGLANG_VERSIONS = ("0.5.15", "0.5.23")
"""The SGLang releases whose module paths the fakes reproduce: before and after the move."""


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """SGLang's bucket object (its unpickler admits it; its senders pickle a dict instead)."""

    supports_multi_dtypes = True

    def __init__(self, flattened_tensor: torch.Tensor, metadata: list[FlattenedTensorMetadata]
                 ) -> None:
        self.metadata = metadata
        self.flattened_tensor = flattened_tensor


def _local_serialized_tensor(module: str) -> type:
    @dataclass
    class LocalSerializedTensor:
        values: list[bytes]

    LocalSerializedTensor.__module__ = module
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    return LocalSerializedTensor


FlattenedTensorMetadata.__module__ = BUCKET_MODULE
FlattenedTensorBucket.__module__ = BUCKET_MODULE
LocalSerializedTensor = _local_serialized_tensor(WEIGHT_UPDATER_MODULE)
LegacyLocalSerializedTensor = _local_serialized_tensor(RUNNER_MODULE)
LOCAL_SERIALIZED_TENSOR = {"0.5.15": LegacyLocalSerializedTensor, "0.5.23": LocalSerializedTensor}
"""SGLang version -> its LocalSerializedTensor (pickled under that version's module path)."""


@contextlib.contextmanager
def sglang_modules() -> Iterator[None]:
    """SGLang's module paths in sys.modules, for pickling only; removed on exit."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", BUCKET_MODULE,
             "sglang.srt.model_executor", RUNNER_MODULE,
             "sglang.srt.model_executor.model_runner_components", WEIGHT_UPDATER_MODULE]
    assert not any(n in sys.modules for n in names), "a real or stale sglang is imported"
    modules = {n: types.ModuleType(n) for n in names}
    modules[BUCKET_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
    modules[BUCKET_MODULE].FlattenedTensorBucket = FlattenedTensorBucket
    for cls in LOCAL_SERIALIZED_TENSOR.values():
        modules[cls.__module__].LocalSerializedTensor = cls
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """CPU tensors pickled by name (what a CPU trainer must choose; CUDA uses IPC handles)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def mp_serialize(obj: object, output_str: bool = False) -> bytes | str:
    """SGLang's MultiprocessingSerializer.serialize."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("utf-8") if output_str else data


def flattened_bucket(named_tensors: list[tuple[str, torch.Tensor]], as_bytes: bool = True
                     ) -> dict[str, object]:
    """SGLang's FlattenedTensorBucket(named_tensors=...) as slime sends it (get_flattened_tensor,
    get_metadata). `as_bytes`: the multi-dtype version (uint8, byte indices)."""
    metadata, pieces, idx = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.flatten()
        if as_bytes:
            flat = flat.view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                start_idx=idx, end_idx=idx + flat.numel(),
                                                numel=flat.numel()))
        pieces.append(flat)
        idx += flat.numel()
    return {"flattened_tensor": torch.cat(pieces, dim=0), "metadata": metadata}


def slime_payloads(named_tensors: list[tuple[str, torch.Tensor]], as_bytes: bool = True
                   ) -> tuple[list[str], list[object]]:
    """slime's colocated refit, one engine rank: (serialized_named_tensors, long-lived data).

    Multi-dtype SGLang: one bucket; older SGLang: one bucket per dtype (one call each)."""
    if as_bytes:
        groups = [named_tensors]
    else:
        by_dtype: dict[torch.dtype, list] = {}
        for name, tensor in named_tensors:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        groups = list(by_dtype.values())
    keep = [flattened_bucket(group, as_bytes) for group in groups]
    with sglang_modules():
        return [mp_serialize(data, output_str=True) for data in keep], keep


def verl_payload(named_tensors: list[tuple[str, torch.Tensor]], tp_size: int = 1,
                 other_ranks: bytes | None = None, sglang_version: str = "0.5.23") -> list[str]:
    """sglang weight_sync.update_weights as verl calls it, then verl's HTTP base64 encoding.

    Rank 0's values are the real tensors; other ranks' values are `other_ranks` (what a
    tp_size > 1 gather would hold for other GPUs), never read by a rank-0 receiver.
    `sglang_version` picks the module path LocalSerializedTensor is pickled under."""
    local_tensor = LOCAL_SERIALIZED_TENSOR[sglang_version]
    with sglang_modules():
        batch = [(name, mp_serialize(tensor)) for name, tensor in named_tensors]
        named = [(name, local_tensor(values=[data] + [other_ranks] * (tp_size - 1)))
                 for name, data in batch]
        serialized = [mp_serialize(named) for _ in range(tp_size)]
    return [base64.b64encode(s).decode("utf-8") for s in serialized]
