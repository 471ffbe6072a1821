"""LoRA in a forward: the pool of adapter slots on the model's device, and one batch's segments.

A projection with adapters is its base product, computed once for every row, plus, for each
adapter slot the batch uses, the low-rank update of that slot's rows::

    y        = x W^T (+ b)                                   all rows, one product
    y[rows] += (x[rows] A^T) B^T * scale                     per slot: shrink, then expand

Fused projections keep their fusion: a slot's A matrices of q, k and v (gate and up) are
stacked, so one shrink serves the group, and each sub-projection's expand adds into its own
columns of the fused output. Where it pays (`Stack`), the batch's slots are stacked too: one
shrink of every row by every slot's A, a mask keeping each row's own slot's columns (scaled),
one expand per sub-projection, so the number of products does not grow with the number of
adapters; otherwise the slots go one by one. A forward with no adapter carries no
``LoraBatch`` at all (``ForwardBatch.lora`` is None) and the model runs exactly as without
LoRA.

    pool.a[(layer, group)]   [slots, subs * max_rank, in]   a slot's present sub-projections'
                                                            A, each rank rows, back to back
    pool.b[(layer, module)]  [slots, out, max_rank]         B, its first rank columns used

Under ``enable_deterministic_inference`` the slots go one by one and the products are the
small-GEMM kernel's (each row one fixed sum), so a row's update does not depend on the rows
beside it (stacked, its sum's order would follow the other slots' columns).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rollout_engine.models import batch_invariant

__all__ = ["GROUPS", "MLP_MODULES", "MODULES", "LoraBatch", "LoraPool", "LoraShapes"]

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by the names PEFT writes."""
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Our fused projection -> the PEFT modules stacked in it, in column order."""

Weights = Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoraShapes:
    """What an adapter's tensors must fit: each module's (in, out) features, the layers, and
    the layers whose MLP is dense (a mixture-of-experts layer's experts take no adapter)."""

    features: Mapping[str, tuple[int, int]]
    num_layers: int
    dense_mlp_layers: frozenset[int]

    @classmethod
    def of(cls, arch: Any) -> LoraShapes:
        """From a ``ModelArch`` (one rank: tensor parallelism is not combined with LoRA)."""
        h, i = arch.hidden_size, arch.intermediate_size
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        moe_layers = set(arch.moe.moe_layers) if arch.moe is not None else set()
        return cls({"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                    "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)},
                   arch.num_layers,
                   frozenset(x for x in range(arch.num_layers) if x not in moe_layers))

    def has(self, layer: int, module: str) -> bool:
        """Whether ``module`` of ``layer`` is a projection of ours an adapter may target."""
        return 0 <= layer < self.num_layers and module in self.features and (
            module not in MLP_MODULES or layer in self.dense_mlp_layers)


class LoraPool:
    """``num_slots`` adapters' weights on the model's device, for the ``modules`` the engine
    serves. ``write`` fills a slot (the caller owns which adapter sits where); the rank, scale
    and present sub-projections of each slot are kept beside the buffers."""

    STACKED_SETS = 4   # sets of slots whose stacks are kept (each a copy of their weights)

    def __init__(self, shapes: LoraShapes, num_slots: int, max_rank: int,
                 modules: frozenset[str], dtype: torch.dtype, device: torch.device) -> None:
        self.shapes, self.num_slots, self.max_rank = shapes, num_slots, max_rank
        self.device = device
        self.modules = frozenset(modules)
        self.groups = {g: tuple(m for m in subs if m in self.modules)
                       for g, subs in GROUPS.items()}
        self.columns: dict[str, tuple[int, int]] = {}   # module -> its columns in the group
        for subs in GROUPS.values():
            start = 0
            for m in subs:
                width = shapes.features[m][1]
                self.columns[m] = (start, start + width)
                start += width
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(shapes.num_layers):
            for group, subs in self.groups.items():
                subs = tuple(m for m in subs if shapes.has(layer, m))
                if not subs:
                    continue
                in_features = shapes.features[subs[0]][0]
                self.a[(layer, group)] = torch.zeros(
                    num_slots, len(subs) * max_rank, in_features, dtype=dtype, device=device)
                for m in subs:
                    self.b[(layer, m)] = torch.zeros(num_slots, shapes.features[m][1], max_rank,
                                                     dtype=dtype, device=device)
        self.rank = [0] * num_slots
        self.scale = [0.0] * num_slots
        self.present: list[dict[tuple[int, str], tuple[str, ...]]] = [{} for _ in
                                                                      range(num_slots)]
        # slots of a batch -> (layer, group) -> their stack (None: stacking does not pay),
        # for the last STACKED_SETS sets of slots; every write empties it
        self._stacks: OrderedDict[tuple[int, ...], dict[tuple[int, str], Optional[Stack]]] = \
            OrderedDict()
        # a stack's columns (slot, scale of each) -> the one pair of tensors all stacks with
        # those columns share (a batch computes one mask for them: `LoraBatch.mask`)
        self.layouts: dict[tuple[tuple[int, float], ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def write(self, slot: int, rank: int, scale: float, weights: Weights) -> None:
        """Put an adapter in ``slot``: ``weights[(layer, module)] = (A [rank, in], B [out,
        rank])``, already checked against the pool's shapes, modules and ``max_rank``."""
        present: dict[tuple[int, str], tuple[str, ...]] = {}
        for (layer, group), a in self.a.items():
            subs = tuple(m for m in self.groups[group] if (layer, m) in weights)
            for j, m in enumerate(subs):
                lora_a, lora_b = weights[(layer, m)]
                a[slot, j * rank:(j + 1) * rank].copy_(lora_a, non_blocking=True)
                self.b[(layer, m)][slot, :, :rank].copy_(lora_b, non_blocking=True)
            if subs:
                present[(layer, group)] = subs
        self.rank[slot], self.scale[slot], self.present[slot] = rank, scale, present
        self._stacks.clear()
        self.layouts.clear()

    def stack(self, slots: tuple[int, ...], layer: int, group: str) -> Optional[Stack]:
        """``slots``' adapters of ``group`` in ``layer`` stacked (`Stack`), built at first
        use after a write; None where none of them has the group or stacking does not pay."""
        stacks = self._stacks.get(slots)
        if stacks is None:
            stacks = self._stacks[slots] = {}
            while len(self._stacks) > self.STACKED_SETS:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(slots)
        key = (layer, group)
        if key not in stacks:
            stacks[key] = Stack.of(self, slots, layer, group)
        return stacks[key]


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``; batch-invariant (the small-GEMM kernel) when the forward must be."""
    if batch_invariant.active():
        return batch_invariant.kernel()(x.contiguous(), w.contiguous(), None)
    return F.linear(x, w)


class Stack:
    """The adapters of a batch's slots for one projection group of one layer, stacked so a
    forward applies them all in a fixed number of products whatever the number of slots::

        s        = x a^T                    [T, K]   every row through every slot's A
        s       *= mask                     [T, K]   a row keeps its own slot's columns, scaled
        y[:, m] += s[:, k0:k1] b_t[m]       per sub-projection m of the group

    ``a`` ``[K, in]`` holds, sub-projection after sub-projection, each slot's A rows of it at
    its own rank (``col_slot``/``col_scale``: the slot and scale of each of the K columns);
    ``subs`` lists (the columns of m in ``s``, its B's stacked ``[K_m, out_m]``, its columns
    in the fused output). A row outside every segment multiplies zeros. The slots' other rows
    cost (K - a row's own rank) wasted columns, so a group is stacked only while ``K`` stays
    small next to its base product (`MAX_EXTRA`)."""

    MAX_EXTRA = 0.25   # the stack's multiply-adds a row, over the base product's, at most

    def __init__(self, a: torch.Tensor, col_slot: torch.Tensor, col_scale: torch.Tensor,
                 subs: list[tuple[int, int, torch.Tensor, int, int]]) -> None:
        self.a, self.col_slot, self.col_scale, self.subs = a, col_slot, col_scale, subs

    @classmethod
    def of(cls, pool: LoraPool, slots: tuple[int, ...], layer: int, group: str
           ) -> Optional[Stack]:
        a_pool = pool.a.get((layer, group))
        if a_pool is None:
            return None
        a_rows: list[torch.Tensor] = []
        col_slot: list[int] = []
        col_scale: list[float] = []
        subs = []
        k = 0
        for m in pool.groups[group]:
            k0, b_rows = k, []
            for slot in slots:
                present = pool.present[slot].get((layer, group), ())
                if m not in present:
                    continue
                r, j = pool.rank[slot], present.index(m)
                a_rows.append(a_pool[slot, j * r:(j + 1) * r])
                b_rows.append(pool.b[(layer, m)][slot, :, :r].t())
                col_slot += [slot] * r
                col_scale += [pool.scale[slot]] * r
                k += r
            if b_rows:
                lo, hi = pool.columns[m]
                subs.append((k0, k, torch.cat(b_rows).contiguous(), lo, hi))
        if not subs:
            return None
        in_features, width = a_pool.shape[2], max(hi for *_, hi in subs)
        extra = k * in_features + sum((k1 - k0) * (hi - lo) for k0, k1, _, lo, hi in subs)
        if extra > cls.MAX_EXTRA * in_features * width:
            return None
        layout = tuple(zip(col_slot, col_scale))
        if layout not in pool.layouts:
            device = a_pool.device
            pool.layouts[layout] = (torch.tensor(col_slot, device=device),
                                    torch.tensor(col_scale, dtype=a_pool.dtype, device=device))
        return cls(torch.cat(a_rows).contiguous(), *pool.layouts[layout], subs)

    def apply(self, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> None:
        """``out += `` the update of every row of ``x`` (``mask``: `LoraBatch.mask`)."""
        s = F.linear(x, self.a)
        s.mul_(mask)
        for k0, k1, b_t, lo, hi in self.subs:
            out[:, lo:hi].addmm_(s[:, k0:k1], b_t)


class LoraBatch:
    """One forward's adapter segments: ``segments[i] = (slot, rows)``, the token rows (an int64
    index on the device; None: every row of the forward) whose adapter sits in ``slot``. Each
    row is in at most one segment."""

    def __init__(self, pool: LoraPool, segments: list[tuple[int, Optional[torch.Tensor]]]
                 ) -> None:
        self.pool = pool
        self.segments = segments
        self.slots = tuple(sorted(slot for slot, _ in segments))
        self._row_slot: Optional[torch.Tensor] = None
        self._masks: dict[int, torch.Tensor] = {}   # id(a Stack's col_slot) -> its mask

    def _mask(self, stack: Stack, num_rows: int) -> torch.Tensor:
        """``[T, K]``: a row's scale in its own slot's columns of ``stack``, else 0."""
        mask = self._masks.get(id(stack.col_slot))
        if mask is None:
            if self._row_slot is None:
                row_slot = torch.full((num_rows,), -1, dtype=torch.int64,
                                      device=stack.col_slot.device)
                for slot, rows in self.segments:
                    row_slot[slice(None) if rows is None else rows] = slot
                self._row_slot = row_slot
            hit = self._row_slot[:, None] == stack.col_slot[None, :]
            mask = torch.where(hit, stack.col_scale, torch.zeros((), dtype=stack.col_scale.dtype))
            self._masks[id(stack.col_slot)] = mask
        return mask

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the base product of ``group`` over ``x``, ``[T, columns]``) += each
        segment's low-rank update, in place."""
        pool = self.pool
        if not batch_invariant.active():   # there each row's update is the per-slot sum
            stack = pool.stack(self.slots, layer, group)
            if stack is not None:
                stack.apply(x, out, self._mask(stack, x.shape[0]))
                return
        a = pool.a.get((layer, group))
        if a is None:
            return
        for slot, rows in self.segments:
            subs = pool.present[slot].get((layer, group))
            if not subs:
                continue
            r, scale = pool.rank[slot], pool.scale[slot]
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = _product(xs, a[slot, :len(subs) * r])
            for j, m in enumerate(subs):
                delta = _product(shrunk[:, j * r:(j + 1) * r], pool.b[(layer, m)][slot, :, :r])
                lo, hi = pool.columns[m]
                if rows is None:
                    out[:, lo:hi].add_(delta, alpha=scale)
                else:
                    out[:, lo:hi].index_add_(0, rows, delta, alpha=scale)
