"""Which quantization a checkpoint's ``config.json`` says its tensors carry, and the method
a server runs (`resolve_method`).

Formats read (``quantization_config``):

    SGLang / DeepSeek FP8   ``quant_method: "fp8"``, ``weight_block_size: [128, 128]``,
                            ``activation_scheme: "dynamic"``; tensors ``weight`` (e4m3) and
                            ``weight_scale_inv`` -> ``fp8``
    SGLang int8             ``quant_method: "w8a8_int8"``; ``weight`` (int8), ``weight_scale``
                            ``[N, 1]`` -> ``w8a8_int8``
    compressed-tensors      ``quant_method: "compressed-tensors"`` with one config group over
                            ``Linear``: weights int 8-bit symmetric per channel, input
                            activations int 8-bit symmetric dynamic per token
                            (``format: "int-quantized"``) -> ``w8a8_int8``; weights float
                            8-bit in ``[128, 128]`` blocks, input activations float 8-bit
                            dynamic per group of 128 (``format: "float-quantized"``) -> ``fp8``

Anything else under ``quantization_config`` is refused, naming what was found.
"""

from __future__ import annotations

from typing import Any, Optional

from rollout_engine.quantization import QUANT_METHODS, method_problem
from rollout_engine.quantization.fp8 import BLOCK

__all__ = ["checkpoint_method", "resolve_method"]


def _ct_group(group: dict[str, Any]) -> Optional[str]:
    """The method of one compressed-tensors config group, or None when it is none of ours."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if w.get("num_bits") != 8 or a.get("num_bits") != 8 or not w.get("symmetric", True) \
            or not a.get("symmetric", True) or not a.get("dynamic") or w.get("dynamic"):
        return None
    if (w.get("type") == "int" and a.get("type") == "int" and w.get("strategy") == "channel"
            and a.get("strategy") == "token"):
        return "w8a8_int8"
    if (w.get("type") == "float" and a.get("type") == "float" and w.get("strategy") == "block"
            and list(w.get("block_structure") or []) == [BLOCK, BLOCK]
            and a.get("strategy") == "group" and a.get("group_size") == BLOCK):
        return "fp8"
    return None


def checkpoint_method(hf_config: dict[str, Any]) -> Optional[str]:
    """The method of the checkpoint's tensors (module docstring), None for an unquantized
    checkpoint. Raises ValueError for a ``quantization_config`` of another kind."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    kind = qc.get("quant_method") if isinstance(qc, dict) else None
    if kind == "w8a8_int8":
        return "w8a8_int8"
    if kind == "fp8":
        if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK] \
                or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"the checkpoint's fp8 quantization_config {qc} is not block-wise "
                             f"[{BLOCK}, {BLOCK}] with dynamic activations (the fp8 layout "
                             "implemented)")
        return "fp8"
    if kind == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        methods = {_ct_group(g) for g in groups}
        if len(groups) == 1 and None not in methods and "Linear" in groups[0].get("targets", []):
            return methods.pop()
        raise ValueError("the checkpoint's compressed-tensors quantization_config is none of "
                         "the schemes implemented (one group over Linear: int8 per-channel "
                         "weights with dynamic per-token int8 activations, or fp8 "
                         f"[{BLOCK}, {BLOCK}] block weights with dynamic per-group activations)")
    raise ValueError(f"the checkpoint's quantization_config names quant_method {kind!r}; "
                     f"implemented: {list(QUANT_METHODS)} and compressed-tensors forms of them")


def resolve_method(flag: Optional[str], hf_config: dict[str, Any]) -> Optional[str]:
    """The method a server runs: the checkpoint's when it has one (SGLang reads it too), which
    ``flag`` (``--quantization``) may repeat but not contradict; else ``flag`` (weights
    quantized when loaded). Raises ValueError naming the flag."""
    problem = method_problem(flag)
    if problem is not None:
        raise ValueError(f"--quantization {problem}")
    stored = checkpoint_method(hf_config)
    if stored is not None and flag is not None and flag != stored:
        raise ValueError(f"--quantization {flag!r} contradicts the checkpoint, whose tensors "
                         f"are {stored!r} (its config.json quantization_config)")
    return stored if stored is not None else flag
