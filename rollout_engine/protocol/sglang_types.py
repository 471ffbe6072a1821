"""SGLang's pickled class names, mapped to our own vetted reconstructors (sglang is never imported).

What SGLang-based trainers put in `serialized_named_tensors` (read from SGLang, slime and verl):

    MultiprocessingSerializer.serialize(obj)   ForkingPickler(buf).dump(obj), optionally base64
    FlattenedTensorMetadata                    @dataclass(name, shape: torch.Size, dtype,
                                               start_idx, end_idx, numel) -> NEWOBJ + BUILD
    FlattenedTensorBucket                      flattened_tensor + metadata as instance state
                                               (SGLang's unpickler admits the object; its senders
                                               pickle the two as a dict)
    LocalSerializedTensor                      @dataclass(values: list[bytes]): values[tp_rank]
                                               is a nested MultiprocessingSerializer pickle
    _rebuild_cuda_tensor_modified              monkey_patch_torch_reductions(): torch's
                                               rebuild_cuda_tensor with the device (argument 6)
                                               sent as the GPU's uuid string

Each class is listed under every module path SGLang has defined it in, since a pickle names the
defining module: LocalSerializedTensor lived in model_executor.model_runner, then (from SGLang
0.5.16) in model_executor.model_runner_components.weight_updater, which is where verl's
`sglang.srt.weight_sync.utils.update_weights` pickles it from today. A nested pickle is read by the same restricted unpickler with the same byte
budget, and must hold exactly one tensor (SGLang's `_unwrap_tensor` reads it the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout_engine.protocol.cuda_handles import rebuild_cuda_tensor_args
from rollout_engine.protocol.payload_checks import UnsafePayloadError
from rollout_engine.protocol.tensor_handles import ReadContext, Reconstructor, Record

__all__ = ["SGLANG_GLOBALS", "SglangTensorMetadata"]

_MAX_RANKS = 4096


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class SglangTensorMetadata:
    """One entry of an SGLang flattened bucket's `metadata`: the tensor occupies
    `flattened_tensor[start_idx:end_idx]` (`numel` = end_idx - start_idx elements of the
    flattened tensor, i.e. bytes when it is uint8), reshaped to `shape` as `dtype`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise UnsafePayloadError(f"FlattenedTensorMetadata.name must be a str: {self.name!r}")
        if not isinstance(self.shape, tuple) or len(self.shape) > 64 or not all(
            _is_index(d) for d in self.shape
        ):
            raise UnsafePayloadError(f"FlattenedTensorMetadata {self.name!r}: shape must be "
                                     f"non-negative ints, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise UnsafePayloadError(f"FlattenedTensorMetadata {self.name!r}: dtype must be a "
                                     f"torch dtype, got {self.dtype!r}")
        ok = all(_is_index(v) for v in (self.start_idx, self.end_idx, self.numel))
        if not ok or self.end_idx - self.start_idx != self.numel:
            raise UnsafePayloadError(
                f"FlattenedTensorMetadata {self.name!r}: start_idx={self.start_idx!r}, "
                f"end_idx={self.end_idx!r} and numel={self.numel!r} must be non-negative ints "
                "with end_idx - start_idx == numel"
            )

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SglangTensorMetadata:
        shape = fields["shape"]
        if isinstance(shape, list):
            shape = tuple(shape)
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        return cls(fields["name"], shape, fields["dtype"], fields["start_idx"],
                   fields["end_idx"], fields["numel"])


class _FlattenedTensorMetadata(Record):
    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    QUALNAME = "FlattenedTensorMetadata"

    def check(self, state: dict[str, Any]) -> None:
        self.meta = SglangTensorMetadata.from_fields(state)

    def materialize(self, ctx, convert):
        self.filled()
        return self.meta


class _LocalSerializedTensor(Record):
    FIELDS = ("values",)
    QUALNAME = "LocalSerializedTensor"

    def check(self, state: dict[str, Any]) -> None:
        values = state["values"]
        if not isinstance(values, (list, tuple)) or not 0 < len(values) <= _MAX_RANKS or not all(
            isinstance(v, (bytes, str)) for v in values
        ):
            raise UnsafePayloadError("LocalSerializedTensor.values must be a non-empty list of "
                                     "serialized tensors (bytes), one per tensor-parallel rank")

    def materialize(self, ctx, convert):
        values = self.filled()["values"]
        if ctx.tp_rank >= len(values):
            raise UnsafePayloadError(f"LocalSerializedTensor has {len(values)} ranks' values; "
                                     f"this receiver is tensor-parallel rank {ctx.tp_rank}")
        # each rank's value is that rank's own pickle (SGLang: one per rank), with its own shm
        # references, whoever else reads the outer payload: this rank drops them (values of
        # several pickles of one tensor are the same bytes, so equal values prove nothing)
        tensor = ctx.read_nested(values[ctx.tp_rank])
        if not isinstance(tensor, torch.Tensor):
            raise UnsafePayloadError("LocalSerializedTensor value must hold one tensor, got "
                                     f"{type(tensor).__name__}")
        return tensor


class _FlattenedTensorBucket(Record):
    FIELDS = ("metadata", "flattened_tensor")
    QUALNAME = "FlattenedTensorBucket"

    def check(self, state: dict[str, Any]) -> None:
        if not isinstance(state["metadata"], (list, tuple)):
            raise UnsafePayloadError("FlattenedTensorBucket.metadata must be a list of "
                                     f"FlattenedTensorMetadata, got {type(state['metadata']).__name__}")

    def materialize(self, ctx, convert):
        # the dict SGLang's senders pickle instead: sglang_payloads reads that form
        state = self.filled()
        return {"flattened_tensor": convert(state["flattened_tensor"]),
                "metadata": convert(state["metadata"])}


def _rebuild_cuda_tensor_modified(ctx: ReadContext, *args: Any):
    return rebuild_cuda_tensor_args(ctx, args, "_rebuild_cuda_tensor_modified")


_CUDA_REBUILD = Reconstructor("sglang _rebuild_cuda_tensor_modified", _rebuild_cuda_tensor_modified)

SGLANG_GLOBALS: dict[tuple[str, str], Any] = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"):
        _FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): _FlattenedTensorBucket,
    ("sglang.srt.model_executor.model_runner_components.weight_updater",
     "LocalSerializedTensor"): _LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): _LocalSerializedTensor,
    ("sglang.srt.model_executor.weight_updater", "LocalSerializedTensor"):
        _LocalSerializedTensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA_REBUILD,
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA_REBUILD,
}
"""(module, name) as SGLang pickles them -> our record class or reconstructor."""
