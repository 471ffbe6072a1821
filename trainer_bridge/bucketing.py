"""Trainer-facing bucketing: a model's weights as HF-named tensors, packed into flat buckets.

    state_dict_items(model) -> (name, tensor), ... -> pack(..., bucket_bytes) -> FlattenedBucket, ...
                                                      unpack(bucket) -> [(name, tensor), ...]

The byte layout is `rollout_engine.protocol.bucket`'s, so an engine unpacks a bucket (or a
broadcast buffer described by names, dtypes and shapes) exactly as it was packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from rollout_engine.protocol.bucket import (
    Allocator,
    FlattenedBucket,
    bucket_layout,
    pack_buckets,
)

__all__ = [
    "FlattenedBucket",
    "NamedTensors",
    "bucket_layout",
    "nbytes",
    "pack",
    "state_dict_items",
    "unpack",
]

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def pack(named_tensors: NamedTensors, bucket_bytes: int,
         allocate: Optional[Allocator] = None) -> Iterator[FlattenedBucket]:
    """Pack tensors in order into buckets of at most `bucket_bytes` (a bigger tensor gets a
    bucket of its own). Lazy: each bucket is built when asked for, so holding only the current
    one keeps one bucket of memory alive. The tensors are copied; the sources are not touched.
    `allocate(num_bytes, device)` makes each buffer (default `torch.empty`)."""
    return pack_buckets(named_tensors, bucket_bytes, allocate)


def unpack(bucket: FlattenedBucket) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `bucket`, as zero-copy views into its buffer."""
    return bucket.named_tensors()


def state_dict_items(source: Union[nn.Module, NamedTensors, dict[str, Any]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, detached tensor) for every weight of `source`.

    `source` is a module (a `transformers` model: its parameter names are the HF checkpoint
    names), a state dict, or an iterable of (name, tensor) pairs. A tensor that shares storage
    with one already yielded is skipped (tied embeddings: `lm_head.weight` is
    `model.embed_tokens.weight`), so each tensor travels once; the engine re-ties on its side.
    """
    if isinstance(source, nn.Module):
        items: Iterable[tuple[str, Any]] = source.named_parameters(remove_duplicate=False)
    elif isinstance(source, dict):
        items = source.items()
    else:
        items = source
    seen: set[tuple[int, int, tuple[int, ...], torch.device]] = set()
    for name, tensor in items:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected (name, tensor) pairs, got ({name!r}, "
                             f"{type(tensor).__name__})")
        tensor = tensor.detach()
        # identical storage, offset and shape == the same tensor under a second name
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.device)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor


def nbytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Total payload bytes of (name, tensor) pairs."""
    return sum(t.numel() * t.element_size() for _, t in named_tensors)
