"""Rollout routing replay (R3) on the trainer's side: the experts the engine routed each token to
during a rollout, replayed in the trainer's forward so that a mixture-of-experts policy is
scored (and its gradient taken) through the same experts that produced the sample.

The engine's record (``meta_info["routed_experts"]`` with ``return_routed_experts=True``,
SGLang's format) is base64 of a little-endian int32 C-order array ``[rows, num_hidden_layers,
top_k]``: row ``p`` holds the experts token ``p`` of ``prompt + output`` was routed to, ``-1``
in the columns of dense layers; ``rows`` is ``len(prompt) + len(output) - 1`` (the last token
was never forwarded). `decode_routed_experts` turns it into a tensor.

`replay_routing(hf_model, routed_experts)` makes every Qwen3-MoE / Qwen2-MoE sparse block of a
transformers model route by that record, as R3 does: the expert *ids* are the given ones, the
*gates* are the router's own softmax probabilities at those ids (renormalised when the config
says ``norm_topk_prob``), so the router keeps receiving gradient. A position whose row in a
MoE layer is all ``-1`` routes by the router's own top-k.

Indices of a forward: the routers see the batch flattened to ``[B * S, hidden]``. Give
``[R, L, k]`` for a batch of one, ``[B, R, L, k]`` for a padded batch, with ``R`` either ``S``
(every position) or ``S - 1`` (the engine's record: each sequence's last position then routes
itself; under causal attention it changes no earlier position's output). Padding positions
may hold ``-1``; `pad_routed_experts` builds the batch from per-sequence records.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

__all__ = ["decode_routed_experts", "pad_routed_experts", "replay_routing",
           "select_moe_layers"]

_WRAPPERS = re.compile(r"(?:^|\.)_(?:fsdp_wrapped|checkpoint_wrapped|orig)_module(?=\.|$)|"
                       r"(?:^|\.)_orig_mod(?=\.|$)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


def decode_routed_experts(data: str | bytes, num_layers: int, top_k: int,
                          num_tokens: Optional[int] = None) -> torch.Tensor:
    """``[rows, num_layers, top_k]`` int32 from the engine's base64 record (see the module
    docstring). ``num_tokens`` (``len(prompt) + len(output)``), when given, must be
    ``rows + 1``. ValueError on text that is not base64 or does not fit the shape."""
    if num_layers <= 0 or top_k <= 0:
        raise ValueError(f"num_layers and top_k must be positive, got {num_layers}, {top_k}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"routed_experts is not base64: {e}") from None
    per_row = num_layers * top_k * 4
    if len(raw) % per_row:
        raise ValueError(f"routed_experts has {len(raw)} bytes, not a multiple of one row "
                         f"({num_layers} layers x top_k {top_k} x 4 bytes)")
    rows = len(raw) // per_row
    if num_tokens is not None and rows != num_tokens - 1:
        raise ValueError(f"routed_experts has {rows} rows; a sequence of {num_tokens} tokens "
                         f"has {num_tokens - 1} (every token but the last)")
    array = np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(rows, num_layers, top_k)
    return torch.from_numpy(array)


def pad_routed_experts(records: Sequence[Any], seq_len: int,
                       starts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``[B, seq_len, L, k]`` int64 for a padded batch: sequence ``b``'s record (``[n_b, L,
    k]``) at positions ``[starts[b], starts[b] + n_b)``, ``-1`` (the router's own choice)
    everywhere else. ``starts`` defaults to zeros (right padding); with left padding it is
    each sequence's first position, ``seq_len - len(sequence)``."""
    tensors = [torch.as_tensor(r) for r in records]
    if not tensors:
        raise ValueError("pad_routed_experts needs at least one record")
    starts = [0] * len(tensors) if starts is None else list(starts)
    if len(starts) != len(tensors):
        raise ValueError(f"{len(starts)} starts for {len(tensors)} records")
    shape = tuple(tensors[0].shape[1:])
    out = torch.full((len(tensors), seq_len, *shape), -1, dtype=torch.int64)
    for b, (t, start) in enumerate(zip(tensors, starts)):
        if t.dim() != 3 or tuple(t.shape[1:]) != shape:
            raise ValueError(f"record {b} has shape {tuple(t.shape)}; every record must be "
                             f"[rows, layers, k] with the first one's layers and k {shape}")
        if start < 0 or start + t.shape[0] > seq_len:
            raise ValueError(f"record {b} ({t.shape[0]} rows from position {start}) does not "
                             f"fit seq_len={seq_len}")
        out[b, start:start + t.shape[0]] = t
    return out


def select_moe_layers(routed_experts: Any, num_layers: int, moe_layers: Sequence[int],
                      top_k: int, num_experts: int, allow_unrouted: bool = False
                      ) -> torch.Tensor:
    """The record's MoE-layer columns, ``[..., len(moe_layers), top_k]`` int64, checked:
    ``[..., num_layers, top_k]`` integers, every id of a MoE layer in ``[0, num_experts)``
    (or, with ``allow_unrouted``, a whole row of ``-1``), no expert twice in one row. The
    dense layers' columns are not read."""
    t = torch.as_tensor(routed_experts)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"routed_experts must hold integer expert ids, got {t.dtype}")
    if t.dim() < 2 or tuple(t.shape[-2:]) != (num_layers, top_k):
        raise ValueError(f"routed_experts has shape {tuple(t.shape)}; this model needs "
                         f"[..., num_hidden_layers={num_layers}, top_k={top_k}]")
    ids = t.to(torch.int64).index_select(-2, torch.tensor(list(moe_layers), dtype=torch.int64))
    unrouted = (ids == -1).all(-1, keepdim=True) if allow_unrouted else None
    valid = (ids >= 0) & (ids < num_experts)
    if unrouted is not None:
        valid = valid | unrouted
    if not bool(valid.all()):
        bad = ids[~valid][0].item()
        hint = " (or a whole row of -1: the router's own choice)" if allow_unrouted else ""
        raise ValueError(f"routed_experts holds expert id {bad} in a MoE layer; ids must be "
                         f"in [0, {num_experts}){hint}")
    ordered = ids.sort(-1).values
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(dup.any()):
        raise ValueError("routed_experts names the same expert twice for one token and layer")
    return ids


class _ReplayedRouter:
    """A router's forward that keeps its logits and swaps in the given expert ids. Installed
    on the instance (``router.forward``); the class and every other instance are untouched."""

    def __init__(self, original: Any, ids: torch.Tensor, norm: bool) -> None:
        self.original, self.ids, self.norm = original, ids, norm   # ids: [B, R, k]

    def rows(self, tokens: int) -> torch.Tensor:
        """``[tokens, k]``: the replay for a forward over ``B * S == tokens`` positions."""
        b, r, k = self.ids.shape
        if tokens % b or tokens // b - r not in (0, 1):
            raise ValueError(f"routed_experts covers {b} sequence(s) of {r} positions; this "
                             f"forward has {tokens} positions (give S or S - 1 rows per "
                             f"sequence of the batch's length S)")
        s = tokens // b
        ids = self.ids
        if s > r:   # the engine's record: the last position routes itself
            ids = torch.cat([ids, ids.new_full((b, 1, k), -1)], dim=1)
        return ids.reshape(tokens, k)

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, scores, own = self.original(hidden_states)
        given = self.rows(logits.shape[0]).to(own.device)
        replay = given[:, :1] >= 0
        ids = torch.where(replay, given, own)
        gates = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
        if self.norm:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return logits, torch.where(replay, gates.to(scores.dtype), scores), ids


def _sparse_block_types() -> tuple[type, ...]:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock)


def _routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, router) of every supported sparse block, by the block's module name."""
    kinds = _sparse_block_types()
    found = []
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            match = _LAYER.search(_WRAPPERS.sub("", name))
            if match is None:
                raise ValueError(f"cannot tell the layer of the sparse MoE block {name!r} "
                                 f"(expected a name ending in layers.<i>.mlp)")
            found.append((int(match.group(1)), module.gate))
    if not found:
        raise ValueError(f"{type(model).__name__} has no Qwen3-MoE / Qwen2-MoE sparse block "
                         f"to replay routing in")
    return found


def _num_hidden_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"{type(model).__name__} has no config.num_hidden_layers")
    return int(n)


@contextmanager
def replay_routing(model: nn.Module, routed_experts: Any) -> Iterator[None]:
    """Inside the block, every Qwen3-MoE / Qwen2-MoE sparse block of ``model`` (a transformers
    model, possibly wrapped) routes by ``routed_experts`` (see the module docstring for the
    shapes); on exit, even by an exception, the routers are as before. Run the forward and
    the backward inside it (activation checkpointing recomputes the forward in backward).

    ValueError, before anything is changed, for a record that does not fit: its layer count
    is not ``num_hidden_layers``, its last dimension not the routers' top_k, an id out of
    range, or a replay already active on the model; and at the forward, for a sequence
    length the record does not cover."""
    routers = _routers(model)
    num_layers = _num_hidden_layers(model)
    top_k, experts = routers[0][1].top_k, routers[0][1].num_experts
    if any(r.top_k != top_k or r.num_experts != experts for _, r in routers):
        raise ValueError("the model's routers differ in top_k or num_experts")
    if max(i for i, _ in routers) >= num_layers:
        raise ValueError(f"a sparse block sits at a layer >= num_hidden_layers={num_layers}")
    t = torch.as_tensor(routed_experts)
    if t.dim() not in (3, 4):
        raise ValueError(f"routed_experts has shape {tuple(t.shape)}; give [S, L, k] for one "
                         f"sequence or [B, S, L, k] for a padded batch")
    layers = [i for i, _ in routers]
    ids = select_moe_layers(t if t.dim() == 4 else t[None], num_layers, layers, top_k,
                            experts, allow_unrouted=True)
    if ids.shape[1] == 0:
        raise ValueError("routed_experts has no rows")
    if any("forward" in vars(r) for _, r in routers):
        raise ValueError("a router of this model already has its own forward (a replay "
                         "is active: replays do not nest)")
    installed: list[nn.Module] = []
    try:
        for column, (_, router) in enumerate(routers):
            device = router.weight.device
            router.forward = _ReplayedRouter(router.forward, ids[:, :, column].to(device),
                                             bool(router.norm_topk_prob))
            installed.append(router)
        yield
    finally:
        for router in installed:
            del router.forward
