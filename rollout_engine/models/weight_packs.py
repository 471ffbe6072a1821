"""oneDNN's packed copies of float32 CPU linear weights, kept between forwards.

oneDNN multiplies a plain ``[N, K]`` weight by first rearranging it into its blocked layout,
on every call. ``torch.ops.mkldnn._reorder_linear_weight`` does that once and returns the
packed tensor, which ``_linear_pointwise`` takes in the weight's place. Measured on the 2-core
AVX-512 EPYC (the 55M model's shapes, best of 15): 256 rows 5-16% faster per product (the LM
head 19.8 -> 18.8 ms), 1-16 rows 1.4-2.2x (the LM head at 4 rows 2.07 -> 1.20 ms); in the
engine, offline batch 256 +5.8% tok/s (paired rollouts alternating in one process).

A packed copy is the weight's value when it was made. Weights change in place (refits write
raw bytes into the parameters) or get new storage (the shadow swap, sleep and wake); every
such write runs inside ``weight_writes.writing()``, which moves the one weight generation. A
copy is keyed by the generation it was made under, and all are dropped when it moves: the
next product re-packs (~70 ms for the 55M model's 156 MB of matrices, once per refit, on the
first forward after it). The key also holds the weight's storage address, shape and autograd
version, so an in-place torch op outside the block is still caught. The copies cost as much
memory as the weights they pack; a sleep drops them with the weights.

``ROLLOUT_ENGINE_PREPACK=0`` turns packing off (products use the plain weight).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Optional

import torch

from rollout_engine.models import weight_writes

PREPACK_ENV = "ROLLOUT_ENGINE_PREPACK"
PACK_ROWS = 128   # the row count oneDNN is told to pack for (64-2048 measured within noise)

# id(weight) -> (weakref to the weight, key it was packed under, packed copy)
_packs: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}
weight_writes.on_change(_packs.clear)   # a write makes every copy stale


def num_bytes() -> int:
    """Memory held by the packed copies (their elements; oneDNN may pad a little more)."""
    return sum(copy.numel() * copy.element_size() for _, _, copy in _packs.values())


@functools.cache
def packing_ok() -> bool:
    """Whether packed weights are used: on unless ``ROLLOUT_ENGINE_PREPACK=0``, and this
    torch's oneDNN packs and multiplies a probe equal to the plain product."""
    if os.environ.get(PREPACK_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen) for s in ((5, 40), (24, 40), (24,)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        plain = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return bool(torch.allclose(got, plain, rtol=1e-5, atol=1e-5))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _forget(key: int) -> None:
    _packs.pop(key, None)


def _key(weight: torch.Tensor) -> tuple:
    # an inference tensor has no version counter (and changes only inside inference mode)
    version = None if weight.is_inference() else weight._version
    return (weight_writes.generation(), weight.data_ptr(), tuple(weight.shape), version)


def _current(weight: torch.Tensor) -> Optional[torch.Tensor]:
    entry = _packs.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == _key(weight):
        return entry[2]
    return None


def has_current(weight: torch.Tensor) -> bool:
    """Whether ``weight`` has a packed copy that a product would use now."""
    return _current(weight) is not None


def packed(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed copy of a contiguous float32 CPU ``weight [N, K]`` (made now if missing or
    stale), or None when packing is off or does not apply."""
    if not (weight.dim() == 2 and weight.is_contiguous() and packing_ok()):
        return None
    copy = _current(weight)
    if copy is not None:
        return copy
    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    ident = id(weight)
    _packs[ident] = (weakref.ref(weight, lambda _, k=ident: _forget(k)), _key(weight), copy)
    return copy
