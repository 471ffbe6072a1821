"""The LoRA adapters a scheduler serves: their versions, the requests bound to them, their slots.

    load            a checked adapter (weights/lora_adapter.py) becomes its name's current
                    version; every load and upsert gets a new version number
    upsert          the same name, new weights: the new version is current at once; requests
                    already bound keep the version they were bound to (its host copy and pool
                    slot live until the last of them ends)
    a request       is bound, when the scheduler takes it, to its adapter's current version
                    (``Req.lora``), and released when it ends, on every path (refused, aborted,
                    finished: ``RequestLifecycle``); its cache namespace names (adapter name,
                    version), so nothing computed under another adapter or another version
                    of the same one is ever matched
    unload          refused (``BusyError``, HTTP 409) while any request is bound to a version
                    of the name
    a batch         uses at most ``max_loras_per_batch`` versions (admission keeps it so:
                    ``AdapterBudget``); each is copied into a slot of the device pool before
                    the forward if it is not there, evicting the least recently used slot the
                    batch does not need (a pinned adapter's last)

``NoLora`` is the do-nothing twin for an engine without ``enable_lora``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.config.lora import target_modules
from rollout_engine.host_lists import list_tensor
from rollout_engine.models.lora import LoraBatch, LoraPool, LoraShapes
from rollout_engine.protocol.messages import BusyError
from rollout_engine.scheduler.request import Req
from rollout_engine.weights.lora_adapter import (
    AdapterPlan,
    LoraAdapter,
    build_adapter,
    read_adapter_dir,
    read_spec,
)

__all__ = ["AdapterBudget", "AdapterVersion", "LoraRegistry", "NoLora", "create_lora_registry"]

NOT_ENABLED = ("lora_path: this server serves no LoRA adapters; start it with --enable-lora "
               "(or --lora-paths)")


@dataclass(eq=False)
class AdapterVersion:
    """One load of an adapter: its weights, version number, the requests bound to it
    (``users``) and its pool slot (None: not resident)."""

    adapter: LoraAdapter
    version: int
    pinned: bool
    users: int = 0
    current: bool = True
    slot: Optional[int] = None

    @property
    def key(self) -> tuple[str, int]:
        """What the cache namespace of its requests carries."""
        return self.adapter.name, self.version


class AdapterBudget:
    """The adapter versions one batch may use: those of the requests already running (and
    the one being prefilled in chunks), and of the ones admitted beside them."""

    def __init__(self, limit: int, active: Sequence[Req]) -> None:
        self.limit = limit
        self.versions = {r.lora.version for r in active if r.lora is not None}

    def admits(self, req: Req) -> bool:
        v = req.lora
        return v is None or v.version in self.versions or len(self.versions) < self.limit

    def add(self, req: Req) -> None:
        if req.lora is not None:
            self.versions.add(req.lora.version)


class NoLora:
    """LoRA off: a request naming an adapter is refused; nothing else happens."""

    enabled = False

    def refusal(self, req: Req) -> Optional[str]:
        return None if req.lora_name is None else NOT_ENABLED

    def bind(self, req: Req) -> None:
        return None

    def release(self, req: Req) -> None:
        return None

    def budget(self, active: Sequence[Req]) -> AdapterBudget:
        return AdapterBudget(0, ())

    def prepare(self, reqs: Sequence[Req], extend_lens: Sequence[int]) -> Optional[LoraBatch]:
        return None

    def listing(self) -> dict[str, Any]:
        return {}

    def check_integrity(self, inflight: Sequence[Req]) -> None:
        assert all(r.lora is None for r in inflight), "a request holds an adapter without LoRA"


class LoraRegistry:
    """The loaded adapters of one scheduler, over a ``LoraPool`` of ``num_slots`` slots for
    adapters of rank <= ``max_rank`` on ``modules``. Single-threaded (the scheduler loop):
    control calls change it between steps."""

    enabled = True

    def __init__(self, pool: LoraPool, dtype: torch.dtype, max_loaded: Optional[int]) -> None:
        self.pool, self.dtype, self.max_loaded = pool, dtype, max_loaded
        self.current: dict[str, AdapterVersion] = {}
        self.retired: list[AdapterVersion] = []     # replaced or unloaded, still bound
        self.slots: list[Optional[AdapterVersion]] = [None] * pool.num_slots
        self.last_used = [0] * pool.num_slots
        self.num_versions = 0
        self.step = 0

    # -- loading -------------------------------------------------------------------------------
    def build(self, name: str, config: Any, tensors: Any, source: str) -> LoraAdapter:
        """A checked copy of an adapter (ValueError naming the problem; nothing changes)."""
        pool = self.pool
        return build_adapter(name, config, tensors, pool.shapes, pool.max_rank, pool.modules,
                             self.dtype, source)

    def plan(self, config: Any, tensors: Any) -> AdapterPlan:
        """The checks and copies of an adapter's tensors (``AdapterPlan``; ValueError naming
        the problem), to build it from them now and again."""
        pool = self.pool
        return AdapterPlan(config, tensors, pool.shapes, pool.max_rank, pool.modules,
                           self.dtype)

    def add(self, adapter: LoraAdapter, pinned: bool = False, upsert: bool = False
            ) -> AdapterVersion:
        """Make ``adapter`` its name's current version. A name already loaded needs
        ``upsert``; a new one room under ``max_loaded_loras`` (ValueError otherwise)."""
        old = self.current.get(adapter.name)
        if old is not None and not upsert:
            raise ValueError(f"lora_name: an adapter named {adapter.name!r} is already loaded; "
                             "unload it first, or pass upsert: true to replace its weights")
        if old is None and self.max_loaded is not None and len(self.current) >= self.max_loaded:
            raise ValueError(f"lora_name: {len(self.current)} adapters are loaded, "
                             f"max_loaded_loras is {self.max_loaded}; unload one first")
        self.num_versions += 1
        self.current[adapter.name] = AdapterVersion(adapter, self.num_versions, pinned)
        if old is not None:
            self._retire(old)
        return self.current[adapter.name]

    def remove(self, name: str) -> None:
        """Unload ``name``: ValueError if it is not loaded, BusyError while a request is bound
        to any version of it."""
        v = self.current.get(name)
        if v is None:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded "
                             f"(loaded: {sorted(self.current)})")
        users = v.users + sum(r.users for r in self.retired if r.adapter.name == name)
        if users:
            raise BusyError(f"adapter {name!r} is in use by {users} request(s); unload it when "
                            "they have ended (or abort them)")
        del self.current[name]
        self._retire(v)

    def _retire(self, v: AdapterVersion) -> None:
        v.current = False
        if v.users:
            self.retired.append(v)
        else:
            self._drop(v)

    def _drop(self, v: AdapterVersion) -> None:
        if v in self.retired:
            self.retired.remove(v)
        if v.slot is not None:
            self.slots[v.slot] = None
            v.slot = None

    def listing(self) -> dict[str, Any]:
        """The loaded adapters, as SGLang's ``loaded_adapters`` (and each one's version)."""
        return {name: {"lora_id": str(v.version), "lora_name": name,
                       "lora_path": v.adapter.source, "pinned": v.pinned,
                       "version": v.version, "rank": v.adapter.spec.rank}
                for name, v in self.current.items()}

    def check_integrity(self, inflight: Sequence[Req]) -> None:
        """Every version's users are exactly the requests in flight bound to it; a retired
        version is kept only while it has users; a slot and its occupant agree."""
        bound: dict[int, int] = {}
        for r in inflight:
            if r.lora is not None:
                bound[id(r.lora)] = bound.get(id(r.lora), 0) + 1
        for v in [*self.current.values(), *self.retired]:
            assert v.users == bound.pop(id(v), 0), f"adapter {v.key}: {v.users} users recorded"
            assert v.current or v.users, f"retired adapter {v.key} kept without users"
            assert v.slot is None or self.slots[v.slot] is v, f"adapter {v.key}: slot mismatch"
        assert not bound, "a request is bound to an adapter version the registry dropped"
        for i, occupant in enumerate(self.slots):
            assert occupant is None or occupant.slot == i, f"slot {i}'s adapter is elsewhere"

    # -- requests ------------------------------------------------------------------------------
    def refusal(self, req: Req) -> Optional[str]:
        name = req.lora_name
        if name is None or name in self.current:
            return None
        return f"lora_path: no adapter named {name!r} is loaded (loaded: {sorted(self.current)})"

    def bind(self, req: Req) -> None:
        """Bind a request the scheduler takes to its adapter's current version."""
        if req.lora_name is not None:
            v = self.current[req.lora_name]
            v.users += 1
            req.lora, req.lora_key = v, v.key

    def release(self, req: Req) -> None:
        """A request ends: its version loses a user (a retired one with none left goes)."""
        v, req.lora = req.lora, None
        if v is not None:
            v.users -= 1
            if not v.users and not v.current:
                self._drop(v)

    def budget(self, active: Sequence[Req]) -> AdapterBudget:
        return AdapterBudget(self.pool.num_slots, active)

    # -- a forward -----------------------------------------------------------------------------
    def prepare(self, reqs: Sequence[Req], extend_lens: Sequence[int]) -> Optional[LoraBatch]:
        """The segments of a batch whose ``reqs[i]`` computes ``extend_lens[i]`` tokens, in
        order, with every version it uses resident; None when no request has an adapter."""
        bound = [r.lora for r in reqs]
        needed = {v.version: v for v in bound if v is not None}
        if not needed:
            return None
        self.step += 1
        for v in needed.values():
            self._make_resident(v, needed)
        rows: dict[int, list[int]] = {}
        total = 0
        for v, n in zip(bound, extend_lens):
            if v is not None:
                assert v.slot is not None
                rows.setdefault(v.slot, []).extend(range(total, total + n))
            total += n
        device = self.pool.device
        segments: list[tuple[int, Optional[torch.Tensor]]] = [
            (slot, None if len(idx) == total else list_tensor(idx, torch.int64, device))
            for slot, idx in rows.items()]
        return LoraBatch(self.pool, segments)

    def _make_resident(self, v: AdapterVersion, needed: dict[int, AdapterVersion]) -> None:
        if v.slot is None:
            free = [i for i, occupant in enumerate(self.slots) if occupant is None]
            if free:
                slot = free[0]
            else:
                movable = [i for i, o in enumerate(self.slots)
                           if o is not None and o.version not in needed]
                if not movable:   # admission keeps a batch within the slots
                    raise RuntimeError(f"a batch needs more than {len(self.slots)} adapter "
                                       "slots (max_loras_per_batch)")
                slot = min(movable, key=lambda i: (self.slots[i].pinned,  # type: ignore[union-attr]
                                                   self.last_used[i]))
                evicted = self.slots[slot]
                assert evicted is not None
                evicted.slot = None
            spec = v.adapter.spec
            self.pool.write(slot, spec.rank, spec.scale, v.adapter.weights)
            self.slots[slot], v.slot = v, slot
        self.last_used[v.slot] = self.step


def create_lora_registry(config: EngineConfig, arch: Any, dtype: torch.dtype,
                         device: torch.device) -> Union[LoraRegistry, NoLora]:
    """The registry ``config`` asks for, its ``lora_paths`` loaded (ValueError naming a bad
    one); the pool is sized by ``max_lora_rank`` / ``lora_target_modules``, or by the largest
    rank and the modules of the adapters given at start (SGLang's rule)."""
    if not config.enable_lora:
        return NoLora()
    initial = []
    for p in config.lora_paths or []:
        try:
            cfg, tensors = read_adapter_dir(p["lora_path"])
            initial.append((p, cfg, tensors, read_spec(cfg)))
        except ValueError as e:
            raise ValueError(f"lora_paths: adapter {p['lora_name']!r}: {e}") from None
    specs = [spec for *_, spec in initial]
    max_rank = config.max_lora_rank or max(s.rank for s in specs)
    modules = (target_modules(config.lora_target_modules) if config.lora_target_modules
               is not None else frozenset().union(*(s.target_modules for s in specs)))
    pool = LoraPool(LoraShapes.of(arch), config.max_loras_per_batch, max_rank, modules, dtype,
                    device)
    registry = LoraRegistry(pool, dtype, config.max_loaded_loras)
    for p, cfg, tensors, _ in initial:
        try:
            adapter = registry.build(p["lora_name"], cfg, tensors, p["lora_path"])
        except ValueError as e:
            raise ValueError(f"lora_paths: adapter {p['lora_name']!r}: {e}") from None
        registry.add(adapter, pinned=p["pinned"])
    return registry
