"""Weight refit in the scheduler process: from disk, from tensor handles, from a broadcast.

Each path ends in ``loader.load_weights`` (validate every name, shape and dtype, then copy; a
floating tensor of another floating dtype is cast as it is copied), so a bad update changes
nothing. The broadcast side (weight-update groups, posted receives) is ``update_groups.py``.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from rollout_engine.protocol.bucket import FlattenedBucket
from rollout_engine.protocol.sglang_payloads import (
    named_tensors_from_sglang,
    read_refit_payload,
    refit_payload_cap,
)
from rollout_engine.protocol.tensor_handles import OpenedShm
from rollout_engine.protocol.tensor_payload import drop_unread_references
from rollout_engine.weights.disk_reader import load_checkpoint
from rollout_engine.weights.loader import LoadPlan, WeightLoadReport
from rollout_engine.weights.update_groups import (  # the broadcast side, reachable from here
    STAGING_ALIGN,
    Receipt,
    StagingBuffer,
    WeightUpdateGroups,
    aligned_layout,
    declared_dtype,
)

LOAD_FORMATS = (None, "direct", "flattened_bucket")
NamedTensors = list[tuple[str, torch.Tensor]]


def refit_from_disk(model: nn.Module, model_path: str) -> WeightLoadReport:
    """Read the checkpoint straight into the parameters (`disk_reader`); raises
    `PartialLoadError` if reading failed once writing had begun."""
    return load_checkpoint(model, model_path)


def named_tensors_from_payload(payload: Any, load_format: Optional[str]
                               ) -> list[tuple[str, torch.Tensor]]:
    """Turn a deserialized payload into (name, tensor) pairs, checking its declared format."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    sglang = named_tensors_from_sglang(payload, load_format)  # slime's {"flattened_tensor", ...}
    if sglang is not None:
        return sglang
    if load_format == "flattened_bucket":
        buckets = payload if isinstance(payload, list) else [payload]
        out: list[tuple[str, torch.Tensor]] = []
        for b in buckets:
            if not isinstance(b, FlattenedBucket):
                raise ValueError("flattened_bucket payload must hold FlattenedBucket objects")
            out.extend(b.named_tensors())
        return out
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor) for x in payload):
        raise ValueError("named tensors must be a list of (name, tensor) pairs")
    return [(n, t) for n, t in payload]


class MappedStorages:
    """Keeps the CPU shared-memory storages of recent tensor payloads mapped, least recently
    sent first out once they hold more than `max_bytes` (`for_model`: twice its weights).

    A trainer that sends the same shared memory again (its persistent bucket buffers, or
    parameters already moved into shm) is then read through the existing mapping: torch's
    handle cache returns it, so a refit maps nothing and takes no page faults (as SGLang
    caches imported CUDA IPC handles). Every new handle is vetted first by the restricted
    unpickler. Content is never stale: the mapping is the trainer's own memory, read during
    the update call. What is kept stays mapped until pushed out by later payloads or `clear`
    (the scheduler clears it when the weights are released). A lent handle's mapping holds no
    reference of the trainer's: its file is unlinked when the trainer frees the storage or
    dies, and only the mapped memory stays until then.

    It also keeps what recent payloads read to (`remember`), so the very same payload string
    sent again (a trainer whose weights live in shm sends identical handles every refit) is
    not parsed and rebuilt again (`reread`: ~10 us a tensor): identical bytes name the same
    shm files (torch never reuses a name), which are still mapped here, so reading them again
    could only give the same tensors over the same memory. What a read checks of the files
    themselves still runs (each is still at least as long as its mapping: a shrunk file would
    fault on access). A payload is forgotten as soon as one of its storages is pushed out.
    """

    PAYLOADS = 512   # a large model refitted in small buckets sends hundreds of payloads

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lru: OrderedDict[int, torch.UntypedStorage] = OrderedDict()
        self.num_bytes = 0
        # payload key -> (named tensors, the shm storages its read opened, their keys)
        self._payloads: OrderedDict[Any, tuple[list[tuple[str, torch.Tensor]],
                                               list[OpenedShm], frozenset[int]]] = OrderedDict()
        # payload key -> the plan that applied it (a LoadPlan; an adapter load keeps its
        # config and AdapterPlan: control/lora_control.py)
        self._plans: dict[Any, Any] = {}

    @classmethod
    def for_model(cls, model: nn.Module) -> MappedStorages:
        return cls(max_bytes=2 * weight_bytes(model))

    def keep(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Mark the storages of one payload most recent, then evict the oldest of earlier
        payloads while more than `self.max_bytes` are kept."""
        current: set[int] = set()
        for _, tensor in named_tensors:
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata  # the StorageImpl: the same for every view of it
            current.add(key)
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = storage
                self.num_bytes += storage.nbytes()
        evicted = False
        while self.num_bytes > self.max_bytes and self._lru:
            key, storage = next(iter(self._lru.items()))
            if key in current:
                break  # only this payload is left: keep it whole
            del self._lru[key]
            self.num_bytes -= storage.nbytes()
            evicted = True
        if evicted:
            for k in [k for k, (_, _, keys) in self._payloads.items()
                      if not keys <= self._lru.keys()]:
                self._forget(k)

    def remember(self, key: Any, named_tensors: list[tuple[str, torch.Tensor]],
                 opened: list[OpenedShm]) -> None:
        """After `keep(named_tensors)`: `key`'s payload read to `named_tensors`, opening
        `opened` (one entry per open). Kept only when every storage opened is one of those
        tensors' (so kept mapped here), which makes all of them CPU shared memory."""
        keys = frozenset(o.storage._cdata for o in opened)
        if not keys or not keys <= self._lru.keys() or \
                keys != {t.untyped_storage()._cdata for _, t in named_tensors if t.numel()}:
            return
        self._payloads[key] = (named_tensors, opened, keys)
        self._plans.pop(key, None)   # a plan of an earlier read of this key read other tensors
        while len(self._payloads) > self.PAYLOADS:
            self._forget(next(iter(self._payloads)))

    def reread(self, key: Any) -> Optional[list[tuple[str, torch.Tensor]]]:
        """The tensors `key`'s payload read to last time, or None; its storages are marked
        most recent (as `keep` would mark them). Each shm file must still exist (a sender
        that freed it can no longer be sending it) and be long enough. A sender using torch's
        protocol took one shm reference per storage for this read, as each time; opening the
        storage would drop it, so it is dropped here (lent storages carry none)."""
        hit = self._payloads.get(key)
        if hit is None:
            return None
        named_tensors, opened, keys = hit
        for o in opened:
            try:
                if os.stat(o.path).st_size < o.file_bytes:
                    return None   # read it again: that read refuses it, naming the file
            except OSError:
                return None
        self._payloads.move_to_end(key)
        for k in keys:
            self._lru.move_to_end(k)
        for o in opened:
            if not o.lent:
                o.storage._shared_decref()
        return named_tensors

    def plan_of(self, key: Any) -> Any:
        """The plan that applied `key`'s payload (see `refit_from_serialized`), or None."""
        return self._plans.get(key)

    def set_plan(self, key: Any, plan: Any) -> None:
        """`key`'s payload is applied by `plan` from now on (None: by none); nothing is kept
        for a key whose payload is not."""
        if plan is None or key not in self._payloads:
            self._plans.pop(key, None)
        else:
            self._plans[key] = plan

    def _forget(self, key: Any) -> None:
        del self._payloads[key]
        self._plans.pop(key, None)

    @property
    def num_storages(self) -> int:
        return len(self._lru)

    @property
    def num_payloads(self) -> int:
        return len(self._payloads)

    def clear(self) -> None:
        """Drop every storage, payload and plan (the plans keep the parameters' storage of
        their time alive: a sleep that frees the weights clears this first)."""
        self._lru.clear()
        self._payloads.clear()
        self._plans.clear()
        self.num_bytes = 0


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(model.parameters(), model.buffers()))


def refit_from_serialized(model: nn.Module, serialized: list[str], load_format: Optional[str],
                          mapped: Optional[MappedStorages] = None,
                          read_by_others: bool = False,
                          load: Optional[Callable[[NamedTensors], WeightLoadReport]] = None,
                          ) -> WeightLoadReport:
    """Load one ``update_weights_from_tensor`` payload: the one tensor refit every process
    runs (a plain engine, each tensor-parallel rank, an engine with a draft model).

    ``serialized`` is SGLang's list: one payload per tensor-parallel rank (rank r reads entry
    r) or one for all ranks (each takes its slice of whole tensors); the rank is the model's
    (``model.tp``). ``mapped`` keeps the payload's shm mapped after; ``read_by_others``:
    another process reads the same payload and drops the sender's shm references (a
    data-parallel replica other than the first; a rank > 0 reading the one shared payload).
    ``load`` writes the named tensors (default: every one into ``model``; a draft engine
    routes each to its model).

    The same payload string read again (``MappedStorages.reread``) is applied by the plan its
    first read made while that plan is valid (no tensor-parallel agreement to repeat, no
    parameter given other storage since): its checks passed for exactly these tensors."""
    tp = getattr(model, "tp", None)
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    if not isinstance(serialized, list) or not serialized:
        raise ValueError("serialized_named_tensors: must be a non-empty list of strings "
                         "(one per tensor-parallel rank)")
    if size > 1 and len(serialized) not in (1, size):
        raise ValueError(f"serialized_named_tensors: one payload per tensor-parallel rank "
                         f"({size}) or one for all, got {len(serialized)}")
    mine = serialized[rank] if len(serialized) > 1 else serialized[0]
    read_by_others = read_by_others or (rank > 0 and len(serialized) == 1)
    if not read_by_others:
        drop_unread(model, serialized, first=1)   # entries for ranks this engine has not
    key = (mine, load_format)
    named_tensors = (mapped.reread(key) if mapped is not None and not read_by_others
                     and isinstance(mine, (str, bytes)) else None)
    if named_tensors is not None and load is None:
        plan = mapped.plan_of(key)  # type: ignore[union-attr]
        if plan is not None and plan.model is model and plan.valid:
            plan.apply()
            return plan.report
    opened: list[OpenedShm] = []
    if named_tensors is None:
        payload = read_refit_payload(mine, model, tp_rank=rank,   # byte cap from the model
                                     read_by_others=read_by_others, opened=opened)
        named_tensors = named_tensors_from_payload(payload, load_format)
    plan = None
    if load is None:
        plan = LoadPlan(model, named_tensors)
        plan.apply()
        report = plan.report
    else:
        report = load(named_tensors)
    if mapped is not None:
        mapped.keep(named_tensors)
        if not read_by_others:
            if opened:
                mapped.remember(key, named_tensors, opened)
            # kept only with its payload (set_plan drops it otherwise); never with tensor
            # parallelism, whose every write follows an agreement of all ranks
            mapped.set_plan(key, plan if tp is None else None)
    return report


def drop_unread(model: nn.Module, serialized: Any, first: int = 0) -> None:
    """The payload strings of `serialized` from `first` on, which this engine will not read
    (the call was refused, or they are for ranks it does not have): drop the shm references a
    sender using torch's protocol took for their reader (`drop_unread_references`). Our lent
    payloads carry none. The ranks of a tensor-parallel engine read their own strings, so
    nothing is dropped for one."""
    if getattr(model, "tp", None) is not None or not isinstance(serialized, list):
        return
    for data in serialized[first:]:
        if isinstance(data, (str, bytes)):
            drop_unread_references(data, max_bytes=refit_payload_cap(model))


__all__ = ["LOAD_FORMATS", "MappedStorages", "NamedTensors", "Receipt", "STAGING_ALIGN", "StagingBuffer",
           "WeightUpdateGroups", "aligned_layout", "declared_dtype", "drop_unread",
           "named_tensors_from_payload", "refit_from_disk", "refit_from_serialized",
           "weight_bytes"]
