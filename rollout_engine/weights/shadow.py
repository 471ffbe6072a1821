"""Receiving a broadcast straight into a second copy of the parameters, then swapping them in.

An unbucketed ``update_weights_from_distributed`` (``load_format`` None: one broadcast per
tensor) normally lands in a staging buffer and is copied into the parameters once all of it has
arrived, so a broadcast cut off halfway changes no weight. `ShadowWeights` keeps that guarantee
without the copy: each announced tensor is received directly into its rows of a spare tensor
shaped like its parameter (the "shadow"), and once everything arrived the parameter and its
shadow trade storage (``param.data = shadow``); the old storage becomes the spare for the next
update. The rows of a parameter the update does not carry (the vocabulary's padding, a fused
projection's other shards) are copied from the live parameter before the swap.

Memory: one spare per parameter an update has touched, at most the weights' size, which the
staging buffer it replaces would have taken too; freed with the weights (``release``).

Used only where a parameter's storage may change under the model: on CPU (a CUDA graph holds
weight addresses), without tensor parallelism (each rank copies its own slice of a full
tensor), for parameters whose dtype equals the announced one (a cast needs the copy anyway), not for a
quantized model (``--quantization``: what arrives is converted before it is written),
and when the update covers at least half the rows of every parameter it touches. Anything else
takes the staging path, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rollout_engine.memory import huge_pages
from rollout_engine.models import weight_writes
from rollout_engine.protocol.byte_copy import copy_all
from rollout_engine.weights.loader import WeightLoadReport, quantizer, weight_table

MIN_COVERAGE = 0.5
"""An update must carry at least this fraction of each touched parameter's rows: below, copying
the rest into the spare would cost more than the copy the swap saves."""


@dataclass
class InPlacePlan:
    """Where each announced tensor is received (a view into its parameter's spare) and which
    parameters are swapped when the update commits."""

    views: list[torch.Tensor]
    names: list[str]
    params: dict[int, tuple[nn.Parameter, torch.Tensor, list[tuple[int, int]]]]
    num_bytes: int


class ShadowWeights:
    """Spare storage for `model`'s parameters (module docstring); one plan in flight at a time
    per parameter."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.spares: dict[int, torch.Tensor] = {}   # id(param) -> its spare
        self.busy: set[int] = set()                  # params of plans not yet committed

    def plan(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
             shapes: Sequence[tuple[int, ...]]) -> Optional[InPlacePlan]:
        """An in-place plan for an announced update, or None when it must be staged (a name,
        shape or dtype the model would refuse is staged too: it is refused after draining)."""
        if getattr(self.model, "tp", None) is not None or quantizer(self.model).active:
            return None   # a quantized model converts what arrives: staged, then converted
        table = weight_table(self.model)
        ignored = getattr(self.model, "ignored_weight", lambda name: False)
        if len(set(names)) != len(names):
            return None
        touched: dict[int, tuple[nn.Parameter, list[tuple[int, int]]]] = {}
        entries = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            if name not in table or ignored(name):
                return None
            param, row0, rows = table[name]
            if (param.device.type != "cpu" or param.dim() == 0 or param.dtype != dtype
                    or tuple(shape) != (rows, *param.shape[1:])
                    or not param.data.is_contiguous()):
                return None
            touched.setdefault(id(param), (param, []))[1].append((row0, rows))
            entries.append((param, row0, rows))
        if not touched or any(k in self.busy for k in touched):
            return None
        for param, ranges in touched.values():
            if sum(r for _, r in ranges) < MIN_COVERAGE * param.shape[0]:
                return None
        params = {}
        for key, (param, ranges) in touched.items():
            spare = self.spares.get(key)
            if spare is None or spare.shape != param.shape or spare.dtype != param.dtype:
                spare = self.spares[key] = (   # memory of its own (memory/huge_pages.py)
                    huge_pages.empty(param.shape, param.dtype, param.device)
                    if param.data.is_contiguous() else torch.empty_like(param.data))
            params[key] = (param, spare, ranges)
        views = [params[id(p)][1].narrow(0, row0, rows) for p, row0, rows in entries]
        self.busy.update(params)
        return InPlacePlan(views, list(names), params,
                           sum(v.numel() * v.element_size() for v in views))

    def commit(self, plan: InPlacePlan) -> WeightLoadReport:
        """Every byte arrived: fill each spare's rows the update did not carry from the live
        parameter, then swap spare and parameter."""
        with weight_writes.writing(), torch.no_grad():
            # one copy_all for every uncovered range (contiguous rows: plain byte copies, on
            # both threads with streaming stores when large: a bucket that splits a fused
            # projection across calls copies the projection's other half here)
            copy_all([(spare[start:stop], param.data[start:stop])
                      for param, spare, ranges in plan.params.values()
                      for start, stop in _uncovered(ranges, param.shape[0])])
            for key, (param, spare, _) in plan.params.items():
                old = param.data
                param.data = spare
                self.spares[key] = old
        self.busy.difference_update(plan.params)
        return WeightLoadReport(num_tensors=len(plan.names), num_bytes=plan.num_bytes,
                          names=frozenset(plan.names))

    def abort(self, plan: InPlacePlan) -> None:
        """The update failed or was refused: its spares hold partial bytes, the parameters are
        untouched; the spares are reused by the next plan."""
        self.busy.difference_update(plan.params)

    def release(self) -> None:
        """Free the spares of parameters no plan is receiving into (the weights are being
        released)."""
        self.spares = {k: v for k, v in self.spares.items() if k in self.busy}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.spares.values())


def _uncovered(ranges: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The [start, stop) row ranges of [0, total) that no (row0, rows) in `ranges` covers."""
    out, pos = [], 0
    for row0, rows in sorted(ranges):
        if row0 > pos:
            out.append((pos, row0))
        pos = max(pos, row0 + rows)
    if pos < total:
        out.append((pos, total))
    return out

