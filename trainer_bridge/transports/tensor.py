"""Colocated refit: tensors travel as handles (CUDA IPC on GPU, shared memory on CPU) through
`engine.update_weights_from_tensor`; the engine copies from the trainer's memory directly.

    bucket_bytes=None:  one call, every (name, tensor) as its own handle   (load_format None)
    bucket_bytes=B:     pack into flat buckets of <= B bytes, one call per bucket, one handle
                        per call                                        ("flattened_bucket")

Unbucketed CPU tensors are moved into shared memory *in place* by the serializer (as
`Tensor.share_memory_()` does): the trainer's parameters keep their values and stay usable.
Buckets cost one extra copy on the trainer side and far fewer handles (one per bucket); CPU
buckets are packed straight into shared memory, so the serializer does not copy them again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from trainer_bridge.bucketing import nbytes, pack
from trainer_bridge.transports.base import (
    WeightTransport,
    call_all,
    checked,
    spawn,
    step_version,
    with_last,
)

__all__ = ["TensorTransport"]


def shared_buffer(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A bucket buffer; on CPU born in POSIX shared memory (file-name handle), which the
    serializer then sends as is instead of copying the packed bucket into a new shm segment."""
    if device.type != "cpu" or num_bytes == 0:
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(num_bytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (num_bytes,), (1,))


class TensorTransport(WeightTransport):
    """Each call goes to all engines at once (a thread per engine); the next bucket is built
    only after every engine has copied the current one, so at most one bucket is alive."""

    name = "tensor"

    def __init__(self, bucket_bytes: Optional[int] = None, timeout_s: Optional[float] = None
                 ) -> None:
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes: must be a positive int or None, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: str) -> int:
        if self.bucket_bytes is None:
            tensors = list(named_tensors)
            self._call(engines, tensors, None, version, True)
            return nbytes(tensors)
        moved = 0
        for index, bucket, last in with_last(pack(named_tensors, self.bucket_bytes,
                                                         shared_buffer)):
            self._call(engines, bucket, "flattened_bucket",
                       version if last else step_version(version, index), last)
            moved += bucket.buffer.numel()
        return moved

    def _call(self, engines: Sequence[Any], payload: Any, load_format: Optional[str],
              version: str, last: bool) -> None:
        # each engine gets its own serialization: a handle carries one reference per receiver
        futures = [spawn(checked, e, "update_weights_from_tensor", payload,
                         load_format=load_format, flush_cache=last, weight_version=version)
                   for e in engines]
        call_all(futures, self.timeout_s)
