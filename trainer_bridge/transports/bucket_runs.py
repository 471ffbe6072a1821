"""How a bucketed broadcast cuts a push into engine calls, and packs a call's tensors.

    bucket_runs  the tensors in order, as runs of at most `bucket_bytes` (a bigger tensor alone),
                 a module's projections kept in one run whenever they fit one
    own_bytes    a tensor bigger than a bucket: broadcast as its own bytes, never packed
    pack_run     a run's bytes back to back (SGLang's FlattenedTensorBucket layout) in a buffer
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_engine.protocol.byte_copy import copy_all

__all__ = ["bucket_runs", "module_of", "own_bytes", "pack_run", "run_bytes"]


def module_of(name: str) -> str:
    """The module a weight belongs to: its name without the last two parts
    ("model.layers.3.self_attn.k_proj.weight" -> "model.layers.3.self_attn")."""
    return name.rsplit(".", 2)[0]


def bucket_runs(named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_bytes` bytes together (a bigger tensor
    alone). A run that the next tensor would overflow is cut before its trailing tensors of
    that tensor's module, when something stays before them: a module's projections (q / k / v,
    gate / up), which an engine holds as one fused parameter, then arrive in one call, which
    the engine receives straight into spare storage, where a call carrying a third of a fused
    parameter is staged and copied."""
    runs: list[list[tuple[str, torch.Tensor]]] = []
    run: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if run and used + nbytes > bucket_bytes:
            cut = len(run)
            while cut > 0 and module_of(run[cut - 1][0]) == module_of(name):
                cut -= 1
            cut = cut or len(run)   # the whole run is that module: cut here
            runs.append(run[:cut])
            run = run[cut:]
            used = run_bytes(run)
            if run and used + nbytes > bucket_bytes:   # still too much together
                runs.append(run)
                run, used = [], 0
        run.append((name, tensor.contiguous()))
        used += nbytes
    if run:
        runs.append(run)
    return runs


def run_bytes(group: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in group)


def own_bytes(group: list[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> Optional[torch.Tensor]:
    """A tensor bigger than a bucket is a bucket of its own: its bytes are broadcast as they
    are (packing would only copy them). None for a group that must be packed."""
    if len(group) != 1 or run_bytes(group) <= bucket_bytes:
        return None
    return group[0][1].reshape(-1).view(torch.uint8)


def pack_run(group: list[tuple[str, torch.Tensor]], slot: torch.Tensor) -> torch.Tensor:
    """Copy the tensors' bytes back to back (SGLang's FlattenedTensorBucket layout) into the
    front of `slot`; returns that part."""
    pairs, used = [], 0
    for _, tensor in group:
        nbytes = tensor.numel() * tensor.element_size()
        pairs.append((slot[used:used + nbytes], tensor.detach().reshape(-1).view(torch.uint8)))
        used += nbytes
    copy_all(pairs)
    return slot[:used]
