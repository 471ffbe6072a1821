"""Quantized rollouts: the schemes (int8 W8A8, FP8 block-wise), their CPU products and their
references, the checkpoint formats that carry them, and the conversion a load or a refit
applies to the tensors it is given. Pure tensor math and names: nothing here imports the
engine (the modules that use it are ``models/quant_linear.py`` and ``weights/loader.py``).

Methods (``EngineConfig.quantization``, SGLang's ``--quantization`` names):

    w8a8_int8   int8 weights, one symmetric scale per output row (amax / 127); activations
                int8 per token, scaled at run time; int32 accumulation; fp32 rescale
    fp8         e4m3 weights in 128 x 128 blocks with one scale each (``weight_scale_inv``,
                DeepSeek's / SGLang's layout); activations per token and group of 128.
                On CPU emulated: blocks dequantized once at load / refit, activations
                quantized and dequantized in torch before each product
"""

from __future__ import annotations

from typing import Optional

__all__ = ["QUANT_METHODS", "method_problem"]

QUANT_METHODS = ("w8a8_int8", "fp8")


def method_problem(method: Optional[str]) -> Optional[str]:
    """Why ``method`` is not a quantization this engine runs (None: it is, or it is None)."""
    if method is None or method in QUANT_METHODS:
        return None
    return (f"{method!r} is not implemented; the methods are {list(QUANT_METHODS)} "
            "(or leave it unset for the model's dtype)")
