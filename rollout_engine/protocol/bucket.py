"""Flattened tensor buckets: many named tensors packed into one aligned byte buffer.

A bucket is one 1-D uint8 buffer plus a `TensorMeta` per tensor saying where its bytes live.
Every tensor starts at a multiple of `ALIGN_BYTES`, so its slice can be reinterpreted as its
dtype in place (`Tensor.view(dtype)` needs the byte offset divisible by the item size):

    offset:  0            16                  48    64
    buffer: |a: 3 x fp32 |pad|b: 2x8 bf16    |pad |c: 0-dim int64|
             ^meta a       ^meta b (16-aligned)     ^meta c

Sending a bucket costs one handle instead of one per tensor (SGLang's "flattened_bucket").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import MappingProxyType

import torch

from rollout_engine.protocol.byte_copy import copy_all

__all__ = [
    "ALIGN_BYTES",
    "SUPPORTED_DTYPES",
    "BucketPlan",
    "FlattenedBucket",
    "TensorMeta",
    "dtype_to_str",
    "pack_buckets",
    "plan_buckets",
    "str_to_dtype",
]

ALIGN_BYTES = 16
"""Every tensor's offset is a multiple of this; it covers the largest item size (complex128)."""

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

_DTYPE_BY_NAME = MappingProxyType({str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES})


def dtype_to_str(dtype: torch.dtype) -> str:
    """Canonical wire name of a supported dtype ("float32", "bfloat16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, torch.dtype) or _DTYPE_BY_NAME.get(name) is not dtype:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(_DTYPE_BY_NAME)}")
    return name


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_to_str`; unknown names raise ValueError."""
    dtype = _DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unsupported dtype name {name!r}; supported: {sorted(_DTYPE_BY_NAME)}")
    return dtype


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives inside a `FlattenedBucket.buffer` (offset/nbytes in bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"TensorMeta.name must be a str, got {self.name!r}")
        itemsize = str_to_dtype(self.dtype).itemsize
        if not isinstance(self.shape, tuple) or not all(_is_int(s) and s >= 0 for s in self.shape):
            raise ValueError(
                f"tensor {self.name!r}: shape must be a tuple of non-negative ints, "
                f"got {self.shape!r}"
            )
        if not _is_int(self.offset) or self.offset < 0 or self.offset % itemsize:
            raise ValueError(
                f"tensor {self.name!r}: offset must be a non-negative multiple of {itemsize} "
                f"(the {self.dtype} item size), got {self.offset!r}"
            )
        expected = math.prod(self.shape) * itemsize
        if self.nbytes != expected or not _is_int(self.nbytes):
            raise ValueError(
                f"tensor {self.name!r}: nbytes={self.nbytes!r} but shape {self.shape} of "
                f"{self.dtype} needs {expected} bytes"
            )

    def __reduce__(self):
        # Rebuild through __init__ so unpickled metas are validated (and no BUILD opcode).
        return (TensorMeta, (self.name, self.dtype, self.shape, self.offset, self.nbytes))


@dataclass(frozen=True, eq=False)
class FlattenedBucket:
    """A 1-D contiguous uint8 `buffer` holding the tensors described by `metas`.

    Validated at construction (in range, aligned, non-overlapping), so `named_tensors` cannot
    fail; a buffer shorter than its metas claim raises ValueError ("truncated bucket").
    """

    buffer: torch.Tensor
    metas: tuple[TensorMeta, ...]

    def __post_init__(self) -> None:
        buf = self.buffer
        if not (
            isinstance(buf, torch.Tensor)
            and buf.dtype == torch.uint8
            and buf.dim() == 1
            and buf.is_contiguous()
        ):
            raise ValueError(
                "FlattenedBucket.buffer must be a 1-D contiguous uint8 tensor, got "
                f"{type(buf).__name__} {getattr(buf, 'dtype', '')} {getattr(buf, 'shape', '')}"
            )
        if not isinstance(self.metas, tuple) or not all(
            isinstance(m, TensorMeta) for m in self.metas
        ):
            raise ValueError("FlattenedBucket.metas must be a tuple of TensorMeta")
        used_end, prev_name = 0, None
        for meta in sorted(self.metas, key=lambda m: m.offset):
            end = meta.offset + meta.nbytes
            if end > buf.numel():
                raise ValueError(
                    f"truncated bucket: tensor {meta.name!r} needs bytes [{meta.offset}, {end}) "
                    f"but the buffer has only {buf.numel()} bytes"
                )
            if meta.nbytes and meta.offset < used_end:
                raise ValueError(
                    f"tensor {meta.name!r} overlaps tensor {prev_name!r} in the bucket"
                )
            if (buf.storage_offset() + meta.offset) % str_to_dtype(meta.dtype).itemsize:
                raise ValueError(f"tensor {meta.name!r} is misaligned for {meta.dtype}")
            if meta.nbytes:
                used_end, prev_name = end, meta.name

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy views into `buffer`, one per meta, reinterpreted to the meta's dtype/shape."""
        return [
            (
                meta.name,
                self.buffer[meta.offset : meta.offset + meta.nbytes]
                .view(str_to_dtype(meta.dtype))
                .view(meta.shape),
            )
            for meta in self.metas
        ]

    def __reduce__(self):
        return (FlattenedBucket, (self.buffer, self.metas))


Allocator = Callable[[int, torch.device], torch.Tensor]
"""Makes a bucket's 1-D contiguous uint8 buffer of `num_bytes` on `device`."""


def _align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True, eq=False)
class BucketPlan:
    """One bucket before it is packed: each source tensor beside the meta saying where its
    bytes go, and the buffer size (`num_bytes`) and device they need."""

    entries: tuple[tuple[TensorMeta, torch.Tensor], ...]
    num_bytes: int
    device: torch.device

    def fill(self, buffer: torch.Tensor) -> FlattenedBucket:
        """Copy the sources into `buffer` (1-D uint8, at least `num_bytes`, on `device`; e.g.
        a reused one) and return the bucket over its first `num_bytes`."""
        buffer = buffer[: self.num_bytes]
        with torch.no_grad():  # a requires_grad source must not make the buffer part of a graph
            copy_all((buffer[meta.offset : meta.offset + meta.nbytes].view(tensor.dtype)
                      .view(meta.shape), tensor.detach()) for meta, tensor in self.entries)
        return FlattenedBucket(buffer=buffer, metas=tuple(meta for meta, _ in self.entries))


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[BucketPlan]:
    """Greedily lay tensors out, in order, into buckets of at most `bucket_bytes` bytes.

    A tensor larger than `bucket_bytes` gets a bucket of its own. Dtypes may mix within a bucket;
    devices may not (a device change starts a new bucket). Nothing is copied: `BucketPlan.fill`
    packs a plan into a buffer the caller chooses.
    """
    if not _is_int(bucket_bytes) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    pending: list[tuple[TensorMeta, torch.Tensor]] = []
    used = 0
    device: torch.device | None = None
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        offset = _align(used)
        if pending and (offset + nbytes > bucket_bytes or tensor.device != device):
            assert device is not None
            yield BucketPlan(tuple(pending), used, device)
            pending, offset = [], 0
        meta = TensorMeta(name, dtype_to_str(tensor.dtype), tuple(tensor.shape), offset, nbytes)
        pending.append((meta, tensor))
        used, device = offset + nbytes, tensor.device
    if pending:
        assert device is not None
        yield BucketPlan(tuple(pending), used, device)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    allocate: Allocator | None = None,
) -> Iterator[FlattenedBucket]:
    """`plan_buckets`, each plan packed into a new buffer as the caller asks for it.

    A generator: each bucket is built only when the next one starts, and the caller holding just
    the current bucket keeps only one alive. `allocate(num_bytes, device)` (default
    `torch.empty`) makes each 1-D uint8 buffer, e.g. one born in shared memory.
    """
    for plan in plan_buckets(named_tensors, bucket_bytes):
        if allocate is None:
            buffer = torch.empty(plan.num_bytes, dtype=torch.uint8, device=plan.device)
        else:
            buffer = allocate(plan.num_bytes, plan.device)
        yield plan.fill(buffer)


def bucket_layout(
    names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]]
) -> tuple[tuple[TensorMeta, ...], int]:
    """Offsets of tensors packed in order into one bucket, exactly as `pack_buckets` lays them
    out; both ends of a broadcast compute it from the same (names, dtypes, shapes)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    metas: list[TensorMeta] = []
    used = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=str_to_dtype(dtype)).element_size()
        offset = _align(used)
        metas.append(TensorMeta(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        used = offset + nbytes
    return tuple(metas), used
