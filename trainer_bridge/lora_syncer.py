"""`LoraSyncer`: push a trainer's LoRA adapter, and only it, to one or many engines, every step.

    syncer = LoraSyncer([engine_a, client_b], "policy", transport="tensor")
    report = syncer.sync(peft_model)       # -> LoraSyncReport(bytes, seconds, versions, ...)
    engine.generate(..., lora_path="policy")
    syncer.unload()                        # optional: the adapter leaves every engine

The engines must serve adapters (``enable_lora``, ``max_lora_rank`` >= the adapter's rank,
``lora_target_modules`` covering its modules). The first sync loads the name, every later one
upserts it: requests already bound to the adapter finish on the weights they started with,
later ones use the new; the radix cache is keyed by (adapter, version), so no KV computed under
an earlier version is reused. The base weights are never sent (a full refit is
``WeightSyncer``'s). Engines: in-process ``Engine``s and ``RolloutClient``s alike.

Versions: each load or upsert gives the adapter a new version number on each engine (the
engine's own counter, reported in ``loaded_adapters``); ``LoraSyncReport.versions`` holds them.
The engine has no label for an adapter's version, and requests report no adapter version: a
trainer that wants its step on rollouts relabels the engine's ``weight_version`` itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from trainer_bridge.lora_source import adapter_source
from trainer_bridge.transports.base import WeightSyncError, call_all, spawn
from trainer_bridge.transports.lora import LoraTransport, make_lora_transport

__all__ = ["LoraSyncReport", "LoraSyncer"]


@dataclass(frozen=True)
class LoraSyncReport:
    """One adapter sync: ``bytes`` moved to each engine in ``seconds`` of wall time (packing or
    writing the directory included); ``gbps`` is gigabytes (1e9 bytes) per second;
    ``versions[i]`` is the adapter's version on engine i after the sync."""

    lora_name: str
    bytes: int
    seconds: float
    gbps: float
    versions: tuple[int, ...]
    rank: int
    num_engines: int
    transport: str


class LoraSyncer:
    """Owns an adapter transport to a fixed list of engines (Engines or RolloutClients) and
    the adapter name it syncs.

    transport: "tensor" (colocated: shared-memory / CUDA IPC handles), "disk" (a PEFT
    directory; ``directory`` None: the system temp directory, which a server must see), or a
    ``LoraTransport``. pack (tensor): one flattened bucket (True), the tensors' own handles
    (False), None: packed only when a tensor is on a GPU. timeout_s: per sync, for every
    engine's answer. adapter_name: which adapter of a PeftModel (PEFT's name, "default").
    """

    def __init__(self, engines: Union[Any, Sequence[Any]], lora_name: str,
                 transport: Union[str, LoraTransport] = "tensor", pack: Optional[bool] = None,
                 directory: Optional[str] = None, timeout_s: Optional[float] = None,
                 adapter_name: str = "default") -> None:
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.engines:
            raise ValueError("engines: need at least one engine")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {lora_name!r}")
        self.lora_name = lora_name
        self.adapter_name = adapter_name
        self.transport = (transport if isinstance(transport, LoraTransport) else
                          make_lora_transport(transport, pack, directory, timeout_s))
        self.closed = False
        self.last_report: Optional[LoraSyncReport] = None

    def sync(self, model_or_named_tensors: Any, config: Any = None) -> LoraSyncReport:
        """Load the adapter of a PeftModel (its ``adapter_name`` adapter and config), or of
        (name, tensor) pairs / a state dict with ``config`` (a peft ``LoraConfig`` or an
        ``adapter_config.json`` dict), into every engine under ``lora_name``.

        Names may be PEFT's saved names (with or without ``base_model.model.``) or a
        PeftModel's parameter names (``.lora_A.default.weight``). ValueError, before anything
        is sent, for an adapter without tensors or config, or a tensor not of the config's
        rank; ``WeightSyncError`` when an engine refuses it (a shape the model does not have,
        a rank above its ``max_lora_rank``, a module it does not target: that engine keeps
        the adapter it had). Don't modify the adapter's tensors until this returns.
        """
        if self.closed:
            raise RuntimeError("this LoraSyncer is closed")
        start = time.perf_counter()
        source = adapter_source(model_or_named_tensors, config, self.adapter_name)
        moved, answers = self.transport.push(self.engines, self.lora_name, source)
        seconds = time.perf_counter() - start
        self.last_report = LoraSyncReport(
            lora_name=self.lora_name, bytes=moved, seconds=seconds,
            gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
            versions=tuple(self._version(a) for a in answers), rank=source.rank,
            num_engines=len(self.engines), transport=self.transport.name)
        return self.last_report

    def _version(self, answer: Any) -> int:
        try:
            return int(answer["loaded_adapters"][self.lora_name]["version"])
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError(f"an engine's answer lists no version of adapter "
                                  f"{self.lora_name!r}: {answer!r}") from None

    def unload(self) -> None:
        """Unload the adapter from every engine that has it (each refuses while requests use
        it: finish or abort them first)."""
        def unload_one(engine: Any) -> None:
            if self.lora_name in engine.get_server_info().get("loaded_adapters", {}):
                engine.unload_lora_adapter(self.lora_name)

        call_all([spawn(unload_one, e) for e in self.engines])

    def close(self) -> None:
        """Release the transport's buffers (the adapter stays loaded: see ``unload``)."""
        if not self.closed:
            self.closed = True
            self.transport.close()

    def __enter__(self) -> LoraSyncer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
