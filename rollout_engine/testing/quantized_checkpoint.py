"""Quantized copies of a model directory, in the layouts other projects write, for tests.

    write_quantized(src, dst, "fp8")        SGLang's / DeepSeek's FP8 layout: each decoder
                                            linear's ``weight`` in e4m3 128 x 128 blocks and its
                                            ``weight_scale_inv``; config.json's
                                            ``quantization_config`` {quant_method: fp8,
                                            weight_block_size: [128, 128], activation_scheme:
                                            dynamic, fmt: e4m3}
    write_quantized(src, dst, "w8a8_int8")  compressed-tensors' int8 W8A8 layout (what
                                            llm-compressor saves): ``weight`` int8,
                                            ``weight_scale`` float32 ``[N, 1]``; its
                                            ``quantization_config`` (one group over Linear,
                                            channel weights, dynamic token activations,
                                            lm_head ignored, format int-quantized)

Embeddings, norms and the LM head are copied as they are. The quantization is the engine's own
(``rollout_engine.quantization``), so a refit of the source's tensors must give the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout_engine.quantization import fp8, int8

__all__ = ["COMPRESSED_TENSORS_W8A8", "SGLANG_FP8", "decoder_linear", "write_quantized"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

SGLANG_FP8: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                              "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _args(type_: str, strategy: str, dynamic: bool, observer: Any) -> dict[str, Any]:
    return {"num_bits": 8, "type": type_, "symmetric": True, "strategy": strategy,
            "dynamic": dynamic, "group_size": None, "block_structure": None, "actorder": None,
            "observer": observer, "observer_kwargs": {}}


COMPRESSED_TENSORS_W8A8: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": _args("int", "channel", False, "minmax"),
        "input_activations": _args("int", "token", True, None)}},
}


def decoder_linear(name: str) -> bool:
    """Whether ``name`` is the weight of a decoder layer's linear (what is quantized)."""
    parts = name.split(".")
    return (name.startswith("model.layers.") and parts[-1] == "weight"
            and parts[-2] in _PROJECTIONS)


def write_quantized(src: str | Path, dst: str | Path, method: str) -> Path:
    """``dst`` (new or empty): ``src``'s model with its decoder linears quantized by
    ``method`` ("fp8" or "w8a8_int8") in the layout of the module docstring."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json" \
                and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = SGLANG_FP8 if method == "fp8" else COMPRESSED_TENSORS_W8A8
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not decoder_linear(name):
                    tensors[name] = t
                elif method == "fp8":
                    tensors[name], tensors[name + "_scale_inv"] = fp8.quantize_blocks(t)
                else:
                    tensors[name], tensors[name + "_scale"] = int8.quantize_weight_int8(t)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
