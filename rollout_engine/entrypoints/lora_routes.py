"""LoRA routes (SGLang's): ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``, behind the admin key like the weight-update routes.

The bodies are SGLang's request dataclasses (``io_struct.py``: ``LoadLoRAAdapterReqInput``,
``LoadLoRAAdapterFromTensorsReqInput``, ``UnloadLoRAAdapterReqInput``, with their ``BaseReq``
fields), plus our ``upsert`` on the two loads (a directory load upserts unless told not to). A success answers 200 with SGLang's
``loaded_adapters``; a refused adapter or payload 400 (nothing changed), an unload of an
adapter in use 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from rollout_engine.entrypoints.rl_routes import REQUIRED, ControlRoute, add_control_routes

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

# a directory load of a name already loaded reloads it in place (prime-rl reloads one fixed
# name from each step's directory); upsert: false refuses it instead, as SGLang does
LOAD_FIELDS = {"lora_name": REQUIRED, "lora_path": REQUIRED, "pinned": False, "lora_id": None,
               "upsert": True}
# the payload is serialized_tensors (one string) or, in later SGLang releases,
# serialized_named_tensors (one per tensor-parallel rank): one of the two
FROM_TENSORS_FIELDS = {
    "lora_name": REQUIRED, "config_dict": REQUIRED, "serialized_tensors": None,
    "serialized_named_tensors": None, "pinned": False, "added_tokens_config": None,
    "lora_id": None, "load_format": None, "expected_checksums": None, "upsert": False}
UNLOAD_FIELDS = {"lora_name": REQUIRED, "lora_id": None}

LORA_ROUTES = (
    ControlRoute("/load_lora_adapter", "load_lora_adapter", LOAD_FIELDS, base_req=True,
                 lift=("loaded_adapters",)),
    ControlRoute("/load_lora_adapter_from_tensors", "load_lora_adapter_from_tensors",
                 FROM_TENSORS_FIELDS, base_req=True, lift=("loaded_adapters",)),
    ControlRoute("/unload_lora_adapter", "unload_lora_adapter", UNLOAD_FIELDS, base_req=True,
                 lift=("loaded_adapters",)),
)


def add_lora_routes(app: FastAPI, engine: Engine, admin: list[Any]) -> None:
    """Register the LoRA routes; ``admin`` is the admin-key dependency list."""
    add_control_routes(app, engine, LORA_ROUTES, admin)
