"""Architecture name (``config.json`` ``architectures[0]``) -> model class."""

from __future__ import annotations

from typing import Optional

from torch import nn

from rollout_engine.models.llama import LlamaForCausalLM, ModelArch
from rollout_engine.parallel.context import TPContext

# Qwen2 and Qwen3 differ from Llama only in flags that ModelArch reads from the config
# (qkv bias, q/k norm), and their MoE variants only in the MLP of some layers (ModelArch.moe),
# so one class serves all five.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(arch: ModelArch, tp: Optional[TPContext] = None,
                quant: Optional[str] = None) -> nn.Module:
    """The model of ``arch``; with ``tp``, one tensor-parallel rank's part of it; ``quant``:
    the quantization method of its decoder linears (``rollout_engine/quantization``)."""
    cls = _REGISTRY.get(arch.architecture)
    if cls is None:
        raise ValueError(f"architecture {arch.architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    if quant is not None:
        return cls(arch, tp=tp, quant=quant)
    return cls(arch) if tp is None else cls(arch, tp=tp)
