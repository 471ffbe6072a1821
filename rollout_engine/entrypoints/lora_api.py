"""The Python ``Engine``'s LoRA calls, under SGLang's names (``Engine`` inherits them).

Each returns SGLang's answer as a dict (``{"success": True, "loaded_adapters": {name: {...}}}``)
and raises for a refusal: ``ValueError`` (a bad adapter or payload, an unknown name: HTTP 400),
``EngineBusyError`` (unloading an adapter requests still use: 409). docs/API.md, "LoRA".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from rollout_engine.protocol.shm_lease import ShmLease
from rollout_engine.protocol.tensor_payload import lend_named_tensors

__all__ = ["LoraMethods"]


class LoraMethods:
    """Mixed into ``Engine``, which supplies ``_result`` (a control call's result, or the
    exception its status means)."""

    _result: Callable[..., Any]

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False, *,
                          upsert: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter in directory ``lora_path`` (``adapter_config.json`` +
        ``adapter_model.safetensors``) as ``lora_name``. ``upsert``: replace the weights of
        an adapter already loaded under that name (requests already taken finish on the old
        weights; later ones use the new). ``pinned``: its pool slot is evicted last."""
        return self._lora("load_lora_adapter", lora_name=lora_name, lora_path=lora_path,
                          pinned=pinned, upsert=upsert)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any,
                                       config_dict: dict[str, Any],
                                       load_format: Optional[str] = None, pinned: bool = False,
                                       added_tokens_config: Optional[dict[str, Any]] = None, *,
                                       upsert: bool = False) -> dict[str, Any]:
        """Load an adapter from tensors: (name, tensor) pairs (or a dict) named as PEFT names
        them, a flattened bucket with ``load_format="flattened_bucket"``, or an already
        serialized payload string. ``config_dict``: its ``adapter_config.json``. The tensors
        travel as handles (shared memory / CUDA IPC), lent until the call is answered; the
        engine keeps copies of its own."""
        lease = ShmLease()
        if isinstance(tensors, (str, bytes)):
            serialized = tensors
        else:
            if not isinstance(tensors, (list, tuple, dict)) and hasattr(tensors, "__iter__") \
                    and not hasattr(tensors, "named_tensors"):
                tensors = list(tensors)   # e.g. a generator of pairs
            serialized, lease = lend_named_tensors(tensors)
        with lease:
            return self._lora("load_lora_adapter_from_tensors", lora_name=lora_name,
                              config_dict=config_dict, serialized_tensors=serialized,
                              load_format=load_format, pinned=pinned,
                              added_tokens_config=added_tokens_config, upsert=upsert)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload ``lora_name``; ``EngineBusyError`` while requests use it."""
        return self._lora("unload_lora_adapter", lora_name=lora_name)

    def _lora(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return {"success": True, **self._result(method, **kwargs)}
