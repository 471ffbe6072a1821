"""LoRA adapters as PEFT writes them, read and checked before anything is kept.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(a pickled ``adapter_model.bin`` is refused: unpickling runs code). Its tensors are named::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_B.weight     [out, r]

(``base_model.model.`` may be left off, as trainers sending tensors do). The update of a
projection is ``x A^T B^T * scale`` with ``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)``
with ``use_rslora``. ``target_modules`` may be ``"all-linear"``.

Refused, with a ValueError naming what: DoRA, a bias other than ``none``, per-module ranks or
alphas, ``modules_to_save``, ``fan_in_fan_out``, a module that is not one of ours (the
embedding, the LM head, a mixture-of-experts layer's experts), a rank above the engine's
``max_lora_rank``, a module outside its ``lora_target_modules``, a tensor of the wrong shape or
not finite, an A without its B. Every tensor is checked before anything is kept:
``build_adapter`` either returns a whole adapter or changes nothing. ``AdapterPlan`` keeps
the checks and the copies of one payload, for a trainer that sends the same memory again.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.models.lora import MODULES, LoraShapes
from rollout_engine.protocol.byte_copy import CopyPlan

__all__ = ["AdapterPlan", "LoraAdapter", "LoraSpec", "build_adapter", "read_adapter_dir", "read_spec"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                   r"(\w+)\.lora_(A|B)\.weight")
_PARENT = {m: "mlp" if m.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
           for m in MODULES}
# PEFT config keys whose non-default values change the math in a way not implemented here
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA adapters are not supported"),
    "bias": ("none", "adapters with trained biases are not supported (bias must be 'none')"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D layouts) is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained extra modules) is not supported"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not supported"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "use_qalora": (False, "QA-LoRA is not supported"),
    "lora_bias": (False, "LoRA biases (lora_bias) are not supported"),
    "target_parameters": (None, "adapters on raw parameters (target_parameters, e.g. "
                                "mixture-of-experts experts) are not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA) is not supported"),
    "trainable_token_indices": (None, "trained token embeddings are not supported"),
    "use_bdlora": (None, "block-diagonal LoRA is not supported"),
    "arrow_config": (None, "Arrow routing over adapters is not supported"),
}
PEFT_DEFAULT_ALPHA = 8


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's ``adapter_config.json``, as far as the engine reads it."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter in host memory: ``weights[(layer, module)] = (A, B)``, contiguous
    views into one buffer of its own in the engine's dtype. ``source``: its directory, or ``__tensor__``."""

    name: str
    spec: LoraSpec
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    source: str

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def read_spec(config: Any) -> LoraSpec:
    """``adapter_config.json``'s content -> ``LoraSpec`` (ValueError naming the problem)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config_dict: must be an object (adapter_config.json), got "
                         f"{type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"peft_type: {peft_type!r} is not a LoRA adapter")
    for key, (default, why) in _REFUSED.items():
        value = config.get(key, default)
        if value not in (default, None) and value != {} and value != []:
            raise ValueError(f"{key}: {why} (got {value!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"r: the adapter's rank must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"use_rslora: must be true or false, got {rslora!r}")
    return LoraSpec(rank, float(alpha), rslora, _target_modules(config.get("target_modules")))


def _target_modules(value: Any) -> frozenset[str]:
    if value == "all-linear":
        return frozenset(MODULES)
    if isinstance(value, str):
        raise ValueError(f"target_modules: a regular expression ({value!r}) is not supported; "
                         f"list the modules ({', '.join(MODULES)}) or use 'all-linear'")
    if not isinstance(value, (list, tuple, set)) or not value or not all(
            isinstance(m, str) for m in value):
        raise ValueError(f"target_modules: must be a list of module names, got {value!r}")
    names = {m.rsplit(".", 1)[-1] for m in value}
    unknown = sorted(names - set(MODULES))
    if unknown:
        raise ValueError(f"target_modules: {unknown} cannot take an adapter here (only "
                         f"{', '.join(MODULES)}: not the embedding, the LM head or "
                         "mixture-of-experts experts)")
    return frozenset(names)


def read_adapter_dir(path: str) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """A PEFT adapter directory's config and tensors (on the CPU), unchecked."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE} (not a PEFT adapter)")
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is a pickle, which is not read: unpickling runs code; save "
            "the adapter with safe_serialization=True)" if pickled else ""))
    try:
        with open(config_path) as f:
            config = json.load(f)
        tensors = load_file(weights_path, device="cpu")
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: {path!r} could not be read: {e}") from None
    return config, list(tensors.items())


def _locate(name: str, shapes: LoraShapes) -> tuple[int, str, str]:
    """A tensor name -> (layer, module, "A" or "B"); ValueError for anything else."""
    m = _NAME.fullmatch(name)
    if m is None or _PARENT.get(m.group(3)) != m.group(2):
        if ".experts." in name or ".shared_expert." in name:
            raise ValueError(f"{name!r}: adapters on mixture-of-experts experts are not "
                             "supported (attention and dense-MLP projections only)")
        raise ValueError(f"{name!r} is not a LoRA weight of a supported module ("
                         f"model.layers.<i>.self_attn|mlp.<{'|'.join(MODULES)}>.lora_A|B"
                         ".weight)")
    layer, module = int(m.group(1)), m.group(3)
    if not shapes.has(layer, module):
        why = (f"layer {layer}'s MLP is a mixture of experts: its experts take no adapter"
               if 0 <= layer < shapes.num_layers else
               f"the model has {shapes.num_layers} layers")
        raise ValueError(f"{name!r}: {why}")
    return layer, module, m.group(4)


def build_adapter(name: str, config: Any, tensors: Iterable[tuple[str, Any]],
                  shapes: LoraShapes, max_rank: int, modules: frozenset[str],
                  dtype: torch.dtype, source: str) -> LoraAdapter:
    """Check ``config`` and every tensor against the model (``shapes``) and the engine's
    ``max_rank`` and ``modules``, then copy them: a ValueError naming the first problem,
    before anything is kept (``AdapterPlan`` made and built once)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"lora_name: must be a non-empty string, got {name!r}")
    return AdapterPlan(config, tensors, shapes, max_rank, modules, dtype).build(name, source)


class AdapterPlan:
    """``build_adapter`` split in two, as ``loader.LoadPlan`` splits a refit. The constructor
    checks the config and every tensor's name, shape and dtype (a ValueError naming the first
    problem) and lays the adapter out in one flat buffer of the engine's dtype. ``build``
    copies the tensors' current values into a buffer of its own (the copies worked out once
    per buffer: ``CopyPlan``), checks the whole buffer finite at once (a ValueError naming a
    non-finite tensor) and returns an adapter whose A and B are views into that buffer. A
    plan may build again for the very same source tensors (a trainer resending the same
    shared memory: ``refit.MappedStorages``); it keeps them alive meanwhile, and reuses the
    buffer of an adapter that is gone (a replaced version no request uses), so a refit
    writes memory already mapped."""

    def __init__(self, config: Any, tensors: Iterable[tuple[str, Any]], shapes: LoraShapes,
                 max_rank: int, modules: frozenset[str], dtype: torch.dtype) -> None:
        spec = read_spec(config)
        if spec.rank > max_rank:
            raise ValueError(f"r: the adapter's rank {spec.rank} is above this engine's "
                             f"max_lora_rank ({max_rank}); start it with a larger "
                             "--max-lora-rank")
        pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
        for tensor_name, t in tensors:
            if not isinstance(tensor_name, str) or not isinstance(t, torch.Tensor):
                raise ValueError("tensors: must be (name, tensor) pairs")
            layer, module, which = _check(tensor_name, t, spec, shapes, modules)
            if which in pairs.setdefault((layer, module), {}):
                raise ValueError(f"{tensor_name!r}: given twice")
            pairs[(layer, module)][which] = (tensor_name, t.detach())
        if not pairs:
            raise ValueError("tensors: the adapter has no LoRA weights")
        for (layer, module), pair in sorted(pairs.items()):
            if len(pair) != 2:
                missing = "B" if "A" in pair else "A"
                raise ValueError(f"layer {layer} {module}: lora_{missing}.weight is missing")
        # the buffer: each (layer, module)'s A then B, back to back, in key order
        self.spec = spec
        self.parts: list[tuple[tuple[int, str], str, int, torch.Size]] = []
        sources: list[torch.Tensor] = []
        offset = 0
        for key in sorted(pairs):
            for which in "AB":
                name, t = pairs[key][which]
                self.parts.append((key, name, offset, t.shape))
                sources.append(t)
                offset += t.numel()
        self.numel, self.dtype, self.sources = offset, dtype, sources
        # buffers in rotation: (the adapter built in it, or None; flat buffer; its views;
        # the copies into it)
        self.buffers: list[tuple[Optional[weakref.ref[LoraAdapter]], torch.Tensor,
                                 dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                                 CopyPlan]] = []

    def _buffer(self) -> int:
        """A buffer no adapter lives in any more (a new one when each is still in use): an
        adapter's weights are views into its buffer, and nothing but the adapter keeps them
        (the device pool copies them), so once it is gone its buffer is free."""
        for i, (ref, *_) in enumerate(self.buffers):
            if ref is None or ref() is None:
                return i
        flat = torch.empty(self.numel, dtype=self.dtype)
        views = [flat[offset:offset + shape.numel()].view(shape)
                 for _, _, offset, shape in self.parts]
        weights = {self.parts[i][0]: (views[i], views[i + 1]) for i in range(0, len(views), 2)}
        self.buffers.append((None, flat, weights, CopyPlan(zip(views, self.sources))))
        return len(self.buffers) - 1

    def build(self, name: str, source: str) -> LoraAdapter:
        """The adapter ``name`` of the sources' current values (ValueError naming the first
        non-finite tensor; nothing is kept then)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name: must be a non-empty string, got {name!r}")
        i = self._buffer()
        _, flat, weights, copies = self.buffers[i]
        with torch.no_grad():   # casts where the sender's dtype is another
            copies.run()
        # a sum is finite only if every element is (inf and nan propagate); a finite buffer
        # whose sum overflows takes the exact check
        if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
            for (key, tensor_name, _, _), which in zip(self.parts, itertools.cycle((0, 1))):
                if not bool(torch.isfinite(weights[key][which]).all()):
                    raise ValueError(f"{tensor_name!r}: holds non-finite values")
        adapter = LoraAdapter(name, self.spec, weights, source)
        self.buffers[i] = (weakref.ref(adapter), flat, weights, copies)
        return adapter


def _check(tensor_name: str, t: torch.Tensor, spec: LoraSpec, shapes: LoraShapes,
           modules: frozenset[str]) -> tuple[int, str, str]:
    """One tensor's name, module, shape and dtype against the model, the engine and the
    adapter's config (its values are checked once the whole adapter is copied); its (layer,
    module, "A" or "B")."""
    layer, module, which = _locate(tensor_name, shapes)
    if module not in modules:
        raise ValueError(f"{tensor_name!r}: {module} is not among this engine's LoRA "
                         f"target modules ({', '.join(sorted(modules))}); start it with "
                         "--lora-target-modules naming it")
    if module not in spec.target_modules:
        raise ValueError(f"{tensor_name!r}: {module} is not in the adapter's "
                         f"target_modules ({', '.join(sorted(spec.target_modules))})")
    in_f, out_f = shapes.features[module]
    want = (spec.rank, in_f) if which == "A" else (out_f, spec.rank)
    if tuple(t.shape) != want:
        raise ValueError(f"{tensor_name!r}: shape {list(t.shape)}, expected {list(want)} "
                         f"(rank r={spec.rank}, {module} maps {in_f} -> {out_f})")
    if not t.is_floating_point():
        raise ValueError(f"{tensor_name!r}: dtype {t.dtype} is not a floating type")
    return layer, module, which
