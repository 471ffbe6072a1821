"""Architecture name (``config.json`` ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from rollout_engine.models.llama import LlamaForCausalLM, ModelArch

# Qwen2 and Qwen3 differ from Llama only in flags that ModelArch reads from the config
# (qkv bias, q/k norm), so one class serves all three.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(arch: ModelArch) -> nn.Module:
    cls = _REGISTRY.get(arch.architecture)
    if cls is None:
        raise ValueError(f"architecture {arch.architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    return cls(arch)
