"""LoRA control calls: load an adapter from a PEFT directory or from tensors, replace one in
place (``upsert``), unload one.

Each runs between batches. A load reads and checks the whole adapter (``weights/lora_adapter``)
before the registry changes, so a bad payload changes nothing; the adapter is copied into the
engine's own memory. A tensor payload's shared memory stays mapped as a full refit's does
(``refit.MappedStorages``, which also keeps the ``AdapterPlan`` that built it): a trainer
sending the same memory again (its adapter moved into shared memory in place, or its reused
bucket) is read through the same mapping and plan, without parsing, checking names and shapes
or planning copies again; its values are copied and checked finite on every load.
Answers carry SGLang's ``loaded_adapters`` (the frontend mirrors it: which names a request may
ask for, ``/v1/models``).

``upsert`` (ours; SGLang refuses a name already loaded): the new weights become the name's
current version at once. Requests the scheduler took before finish on the version they were
bound to; requests it takes after use the new one. The cache never mixes them: the namespace
names the version.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union

from torch import nn

from rollout_engine.protocol.sglang_payloads import read_refit_payload, refit_payload_cap
from rollout_engine.protocol.tensor_handles import OpenedShm
from rollout_engine.protocol.tensor_payload import drop_unread_references
from rollout_engine.scheduler.lora_registry import NOT_ENABLED, LoraRegistry, NoLora
from rollout_engine.weights.lora_adapter import AdapterPlan, read_adapter_dir
from rollout_engine.weights.refit import MappedStorages, named_tensors_from_payload

__all__ = ["LoraControl"]

TENSOR_SOURCE = "__tensor__"   # what SGLang's LoRARef names as the path of tensors


class LoraControl:
    """The LoRA calls over one scheduler's registry; ``model`` bounds a tensor payload's size
    (``refit_payload_cap``)."""

    def __init__(self, registry: Union[LoraRegistry, NoLora], model: nn.Module) -> None:
        self.registry = registry
        self.model = model
        self.mapped = MappedStorages.for_model(model)

    def _enabled(self) -> LoraRegistry:
        if not isinstance(self.registry, LoraRegistry):
            raise ValueError(NOT_ENABLED.replace("lora_path: ", ""))
        return self.registry

    def _answer(self) -> dict[str, Any]:
        return {"loaded_adapters": self.registry.listing()}

    def rpc_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False,
                              upsert: bool = False, lora_id: Optional[str] = None
                              ) -> dict[str, Any]:
        """Load the PEFT adapter in directory ``lora_path`` as ``lora_name`` (``upsert``:
        replace the weights of one already loaded). ``lora_id`` is SGLang's internal id:
        ignored."""
        registry = self._enabled()
        config, tensors = read_adapter_dir(lora_path)
        registry.add(registry.build(lora_name, config, tensors, lora_path), pinned, upsert)
        return self._answer()

    def rpc_load_lora_adapter_from_tensors(
            self, lora_name: str, config_dict: dict[str, Any],
            serialized_tensors: Optional[str] = None, pinned: bool = False,
            load_format: Optional[str] = None, upsert: bool = False,
            added_tokens_config: Optional[dict[str, Any]] = None,
            lora_id: Optional[str] = None,
            serialized_named_tensors: Optional[list[str]] = None,
            expected_checksums: Optional[dict[str, str]] = None) -> dict[str, Any]:
        """Load an adapter sent as tensors: one payload (SGLang's ``MultiprocessingSerializer``,
        or ours: ``protocol/tensor_payload.py``) of (name, tensor) pairs named as PEFT names
        them, or with ``load_format="flattened_bucket"`` a flattened bucket. SGLang's releases
        name the payload ``serialized_tensors`` (one string) or ``serialized_named_tensors``
        (one per tensor-parallel rank: here one). ``config_dict`` is the adapter's
        ``adapter_config.json``."""
        payloads = [p for p in (serialized_tensors, *(serialized_named_tensors or []))
                    if isinstance(p, (str, bytes))]
        try:
            registry = self._enabled()
            if (serialized_tensors is None) == (serialized_named_tensors is None):
                raise ValueError("serialized_tensors: give the payload as serialized_tensors "
                                 "or as serialized_named_tensors (one of them)")
            if serialized_named_tensors is not None and len(serialized_named_tensors) != 1:
                raise ValueError(f"serialized_named_tensors: one payload per tensor-parallel "
                                 f"rank; this engine has one, got "
                                 f"{len(serialized_named_tensors)}")
            if added_tokens_config:
                raise ValueError("added_tokens_config: adapters that add tokens are not "
                                 "supported (the vocabulary is the base model's)")
            if expected_checksums:
                raise ValueError("expected_checksums: checking adapter checksums is not "
                                 "implemented; leave it null")
            if len(payloads) != 1:
                raise ValueError("serialized_tensors: must be one payload string (base64)")
        except ValueError:
            for data in payloads:   # refused unread: the sender's references still dropped
                drop_unread_references(data, max_bytes=refit_payload_cap(self.model))
            raise
        key = (payloads[0], load_format)
        tensors = self.mapped.reread(key)
        kept = self.mapped.plan_of(key) if tensors is not None else None
        plan = kept[1] if kept is not None and kept[0] == config_dict else None
        opened: list[OpenedShm] = []
        if tensors is None:
            payload = read_refit_payload(payloads[0], self.model, opened=opened)
            tensors = named_tensors_from_payload(payload, load_format)
        if plan is None:
            plan = registry.plan(config_dict, tensors)
        registry.add(plan.build(lora_name, TENSOR_SOURCE), pinned, upsert)
        self._keep(key, tensors, opened, config_dict, plan)
        return self._answer()

    def _keep(self, key: Any, tensors: list[Any], opened: list[OpenedShm],
              config: dict[str, Any], plan: AdapterPlan) -> None:
        """Keep a loaded payload's shm mapped, and its plan for the same payload and config."""
        self.mapped.keep(tensors)
        if opened:
            self.mapped.remember(key, tensors, opened)
        self.mapped.set_plan(key, (copy.deepcopy(config), plan))

    def rpc_unload_lora_adapter(self, lora_name: str, lora_id: Optional[str] = None
                                ) -> dict[str, Any]:
        """Unload ``lora_name``: 409 (``BusyError``) while a request uses it."""
        self._enabled().remove(lora_name)
        return self._answer()

    def rpc_list_lora_adapters(self) -> dict[str, Any]:
        return self._answer()
