"""The LoRA routes of the HTTP clients (docs/API.md, "LoRA adapters"), under the Python
``Engine``'s names and answers: ``{"success": True, "loaded_adapters": {name: {...}}}``; a
refused adapter raises ``RolloutError`` (400: a bad adapter or payload, an unknown name; 409:
an unload while requests use the adapter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import httpx

from rollout_engine.protocol.payload_sender import lend_named_tensors
from rollout_engine.protocol.shm_lease import ShmLease

__all__ = ["LoraRoutes"]


def _loaded(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    return {"success": True, **body.get("result", {})}


class LoraRoutes:
    """Mixed into the clients' ``_Routes``, which supply ``_send`` and ``_holding``."""

    _send: Callable[..., Any]
    _holding: Callable[..., Any]

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False, *,
                          upsert: bool = False) -> Any:
        """POST /load_lora_adapter: the PEFT directory ``lora_path`` (a path the server
        reads) as ``lora_name``; ``upsert`` replaces a loaded adapter's weights."""
        return self._send("POST", "/load_lora_adapter", {
            "lora_name": lora_name, "lora_path": lora_path, "pinned": pinned,
            "upsert": upsert}, admin=True, parse=_loaded)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any,
                                       config_dict: dict[str, Any],
                                       load_format: Optional[str] = None, pinned: bool = False,
                                       added_tokens_config: Optional[dict[str, Any]] = None, *,
                                       upsert: bool = False) -> Any:
        """POST /load_lora_adapter_from_tensors: (name, tensor) pairs named as PEFT names them
        (or a dict), a flattened bucket with ``load_format="flattened_bucket"``, or an already
        serialized payload string. The tensors travel as shared-memory / CUDA IPC handles (the
        server must run on this host), lent until the route answers."""
        lease = ShmLease()
        if isinstance(tensors, str):
            serialized = tensors
        else:
            if not isinstance(tensors, (list, tuple, dict)) and not hasattr(
                    tensors, "named_tensors"):
                tensors = list(tensors)   # generators do not pickle
            serialized, lease = lend_named_tensors(tensors)
        body = {"lora_name": lora_name, "config_dict": config_dict,
                "serialized_tensors": serialized, "load_format": load_format,
                "pinned": pinned, "added_tokens_config": added_tokens_config, "upsert": upsert}
        return self._holding(lease, lambda: self._send(
            "POST", "/load_lora_adapter_from_tensors", body, admin=True, parse=_loaded))

    def unload_lora_adapter(self, lora_name: str) -> Any:
        """POST /unload_lora_adapter."""
        return self._send("POST", "/unload_lora_adapter", {"lora_name": lora_name},
                          admin=True, parse=_loaded)
