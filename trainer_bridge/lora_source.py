"""A trainer's LoRA adapter as the engines take it: PEFT's tensor names and its
``adapter_config.json``.

    source = adapter_source(peft_model)                         # a PeftModel's adapter
    source = adapter_source(named_tensors, config=lora_config)  # pairs + LoraConfig or dict
    source.config     adapter_config.json's content (plain JSON: sets become sorted lists)
    source.tensors    [(name, tensor)], named as PEFT saves them:
                      base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    source.save(dir)  the adapter directory (PEFT's save_pretrained for a PeftModel)

The tensors are the trainer's own (detached views, no copy). ``peft`` is imported only when a
PeftModel is given.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["AdapterSource", "adapter_source", "config_dict", "peft_names"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSource:
    """One adapter's config and tensors; ``peft_model`` (with ``adapter_name``) when it came
    from a PeftModel, which then writes the directory itself."""

    config: dict[str, Any]
    tensors: list[tuple[str, torch.Tensor]]
    peft_model: Optional[nn.Module] = None
    adapter_name: str = "default"

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def nbytes(self) -> int:
        """The tensors' bytes."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def save(self, directory: str) -> str:
        """Write the adapter under ``directory`` (an existing, empty directory); returns the
        directory holding ``adapter_config.json`` and ``adapter_model.safetensors``."""
        if self.peft_model is not None:
            self.peft_model.save_pretrained(directory, selected_adapters=[self.adapter_name])
            # PEFT writes a non-default adapter into a subdirectory of its name
            return (directory if self.adapter_name == "default"
                    else os.path.join(directory, self.adapter_name))
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, t in self.tensors:
            t = t.detach().to("cpu").contiguous()
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()   # safetensors refuses tensors that share memory
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(self.config, f, indent=2)
        return directory


def adapter_source(source: Any, config: Any = None, adapter_name: str = "default"
                   ) -> AdapterSource:
    """The adapter of a PeftModel (its ``adapter_name`` adapter's lora_A / lora_B
    parameters; ``config`` None: its own ``peft_config[adapter_name]``), or of (name, tensor)
    pairs / a state dict with ``config`` (a peft ``LoraConfig`` or the dict of an
    ``adapter_config.json``). Names of ``named_parameters()`` (``.lora_A.<adapter>.``)
    become PEFT's saved names. ValueError for no tensors, no config, a tensor that is not a
    LoRA A / B or whose rank is not the config's ``r``."""
    if not isinstance(adapter_name, str) or not adapter_name:
        raise ValueError(f"adapter_name: must be a non-empty string, got {adapter_name!r}")
    peft_model = None
    if isinstance(source, nn.Module):
        if not hasattr(source, "peft_config"):
            raise ValueError("model: not a PeftModel (wrap it with peft.get_peft_model), or "
                             "pass the adapter's (name, tensor) pairs and its config")
        if adapter_name not in source.peft_config:
            raise ValueError(f"adapter_name: the model has no adapter {adapter_name!r} "
                             f"(it has {sorted(source.peft_config)})")
        peft_model = source
        config = source.peft_config[adapter_name] if config is None else config
        # its lora_A / lora_B parameters: the tensors PEFT saves for a LoRA the engine takes
        # (peft's get_peft_model_state_dict gives the same, at ~30 ms a call on a 55M model)
        pairs: Iterable[tuple[str, Any]] = _lora_parameters(source, f".{adapter_name}.weight")
    elif isinstance(source, Mapping):
        pairs = source.items()
    else:
        pairs = source
    if config is None:
        raise ValueError("config: give the adapter's LoraConfig or adapter_config.json dict "
                         "with its tensors")
    cfg = config_dict(config)
    tensors = [(name, t.detach()) for name, t in peft_names(pairs, adapter_name)]
    if not tensors:
        raise ValueError("tensors: the adapter has no tensors")
    _check_rank(cfg, tensors)
    return AdapterSource(cfg, tensors, peft_model, adapter_name)


def _lora_parameters(model: nn.Module, inner: str) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` whose names end in ``inner`` under a ``lora_A`` or
    ``lora_B``, in the same order: the same walk over each module once, without
    ``named_modules``' per-module generators (a third of the time on a PeftModel with many
    adapters, paid on every sync)."""
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    params: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for n, p in module._parameters.items():
            if p is None or id(p) in params:
                continue
            params.add(id(p))
            name = prefix + n
            if name.endswith(inner) and (".lora_A." in name or ".lora_B." in name):
                out.append((name, p))
        for n, child in module._modules.items():
            if child is not None:
                walk(child, prefix + n + ".")

    walk(model, "")
    return out


def peft_names(pairs: Iterable[tuple[str, Any]], adapter_name: str = "default"
               ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with the adapter's name taken out of ``named_parameters()``
    names (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``, as PEFT
    saves them); other names are kept."""
    inner = re.compile(rf"\.lora_(A|B)\.{re.escape(adapter_name)}\.weight$")
    out = []
    for name, t in pairs:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors: expected (name, tensor) pairs, got ({name!r}, "
                             f"{type(t).__name__})")
        out.append((inner.sub(r".lora_\1.weight", name), t))
    return out


def config_dict(config: Any) -> dict[str, Any]:
    """``adapter_config.json``'s content of a peft config (``to_dict``) or a mapping, as plain
    JSON (sets as sorted lists, as PEFT writes them); ValueError naming a key that is not."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"config: must be a peft LoraConfig or a dict, got "
                         f"{type(config).__name__}")
    out = {}
    for key, value in config.items():
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        try:
            out[str(key)] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            raise ValueError(f"config: {key} is not JSON ({type(value).__name__})") from None
    if not isinstance(out.get("r"), int):
        raise ValueError(f"config: r (the rank) must be an integer, got {out.get('r')!r}")
    return out


def _check_rank(config: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Every 2-D lora_A is [r, in] and lora_B [out, r] for the config's r."""
    rank = config["r"]
    for name, t in tensors:
        if ".lora_A." in name or ".lora_B." in name:
            dim = 0 if ".lora_A." in name else 1
            if t.dim() != 2 or t.shape[dim] != rank:
                raise ValueError(f"{name!r}: shape {list(t.shape)} is not of rank r={rank} "
                                 f"(lora_A is [r, in], lora_B [out, r])")
        else:
            raise ValueError(f"{name!r} is not a LoRA weight (lora_A / lora_B); only the "
                             "adapter's tensors are sent")
