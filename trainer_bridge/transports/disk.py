"""The fallback refit: write a safetensors checkpoint, have each engine read it.

Works across any boundary that shares a filesystem (the engines read the path they are
given, so for a remote server `directory` must be a path both sides see). Slowest path: the
bytes go through the page cache twice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from trainer_bridge.transports.base import WeightTransport, call_all, checked, spawn

__all__ = ["DiskTransport"]


class DiskTransport(WeightTransport):
    """Each push writes `<directory>/refit-*/model.safetensors`, loads it on every engine (at
    once, a thread each) and deletes it. `directory=None`: the system temp directory."""

    name = "disk"

    def __init__(self, directory: Optional[str] = None, timeout_s: Optional[float] = None
                 ) -> None:
        self.directory = directory
        self.timeout_s = timeout_s

    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: str) -> int:
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, t in named_tensors:
            if name in tensors:
                raise ValueError(f"weight {name!r} appears twice in one update")
            t = t.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # safetensors refuses tensors that share memory
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        path = tempfile.mkdtemp(prefix="refit-", dir=self.directory)
        try:
            save_file(tensors, os.path.join(path, "model.safetensors"))
            call_all([spawn(checked, e, "update_weights_from_disk", path,
                            weight_version=version) for e in engines], self.timeout_s)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())
