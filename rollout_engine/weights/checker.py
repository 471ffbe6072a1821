"""The weight checker behind SGLang's ``/weights_checker``: proof that a refit wrote what the
trainer holds, over one model's weights (each tensor-parallel rank checks its own slices).

    snapshot        keep a copy (in host memory) of every served weight
    reset_tensors   overwrite every weight with random values, so that an update that
                    misses a tensor leaves it visibly wrong
    compare         every weight against the snapshot: equal bit for bit, or a ``ValueError``
                    listing each one that differs (largest and mean absolute error, how many
                    elements differ)
    checksum        a 64-bit hash of each weight's bytes (16 hex digits) and one over them all

Weights are named as the checkpoint names them (``model.layers.0.self_attn.q_proj.weight``:
what a trainer sends). A name containing one of ``skip`` (SGLang's ``skip_tensor_list``) is
neither reset nor hashed, and a difference there is reported as information, not a failure.
As in SGLang, ``allow_quant_error`` only widens the tolerance of quantized weights (by their
quantization step); this engine's weights are never quantized, so every comparison is exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rollout_engine.models import weight_writes
from rollout_engine.weights.loader import read_weight, weight_table

__all__ = ["Mismatch", "check_equal", "checksums", "digest", "named_weights", "overall",
           "reset", "snapshot"]


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the served tensor (a view into the model's parameter), sorted."""
    return {name: read_weight(model, name) for name in sorted(weight_table(model))}


def _skipped(name: str, skip: Iterable[str]) -> bool:
    return any(pattern in name for pattern in skip)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of every weight (never a view: later writes do not reach it)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in named_weights(model).items()}


@torch.no_grad()
def reset(model: nn.Module, skip: Iterable[str] = ()) -> list[str]:
    """Overwrite every weight not skipped with uniform random values in [0, 1) (random bits
    for integer tensors); returns the names written."""
    skip = list(skip)
    written = []
    with weight_writes.writing():
        for name, t in named_weights(model).items():
            if _skipped(name, skip):
                continue
            if t.dtype.is_floating_point:
                t.copy_(torch.rand(t.shape, dtype=torch.float32, device=t.device))
            elif t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, device=t.device) > 0.5)
            else:
                info = torch.iinfo(t.dtype)
                t.copy_(torch.randint(info.min, info.max, t.shape, dtype=t.dtype, device=t.device))
            written.append(name)
    return written


def digest(t: torch.Tensor) -> str:
    """64-bit hash of a tensor's bytes, as 16 hex digits."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    data: bytes = flat.view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def checksums(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, str]:
    """Checkpoint name -> ``digest`` of every weight not skipped."""
    skip = list(skip)
    return {name: digest(t) for name, t in named_weights(model).items()
            if not _skipped(name, skip)}


def overall(sums: Mapping[str, str]) -> str:
    """One SHA-256 over every (name, checksum), in name order."""
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode())
        h.update(sums[name].encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Mismatch:
    """A weight that differs from its snapshot."""

    name: str
    max_abs_err: float
    mean_abs_err: float
    num_exceed: int      # elements that differ (NaN counts)
    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"name={self.name} max_abs_err={self.max_abs_err} "
                f"mean_abs_err={self.mean_abs_err} num_exceed={self.num_exceed} "
                f"shape={list(self.shape)} dtype={str(self.dtype).replace('torch.', '')}")


def _mismatch(name: str, expect: torch.Tensor, actual: torch.Tensor) -> Optional[Mismatch]:
    if expect.shape != actual.shape:
        raise ValueError(f"{name}: shape {list(actual.shape)} differs from the snapshot's "
                         f"{list(expect.shape)}")
    diff = (actual.detach().cpu().float() - expect.float()).abs()
    if diff.numel() == 0 or bool((diff == 0).all()):
        return None
    finite = torch.nan_to_num(diff, nan=float("inf"))
    return Mismatch(name, float(finite.max()), float(diff.sum()) / diff.numel(),
                    int((~(diff <= 0)).sum()), tuple(actual.shape), actual.dtype)


def check_equal(expect: Mapping[str, torch.Tensor], model: nn.Module,
                skip: Iterable[str] = ()) -> tuple[list[str], list[Mismatch]]:
    """Compare ``model``'s weights with the snapshot ``expect``. Returns (names equal,
    differences in skipped names); raises ``ValueError`` listing every other difference."""
    skip = list(skip)
    actual = named_weights(model)
    if set(actual) != set(expect):
        raise ValueError(f"the model's weights ({len(actual)}) are not the snapshot's "
                         f"({len(expect)}); take a new snapshot")
    equal, tolerated, failed = [], [], []
    for name, tensor in actual.items():
        m = _mismatch(name, expect[name], tensor)
        if m is None:
            equal.append(name)
        elif _skipped(name, skip):
            tolerated.append(m)
        else:
            failed.append(m)
    if failed:
        raise ValueError(f"check tensor equality failed: {len(failed)} of {len(actual)} "
                         "weights differ from the snapshot:\n"
                         + "\n".join(m.describe() for m in failed))
    return equal, tolerated
