"""``--quantization`` (SGLang's flag; vLLM's ``--quantization`` maps to it): the method
names, the checkpoint's own quantization_config, and what it is not combined with."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from rollout_engine.quantization.checkpoint import resolve_method


def check_quantization(c: Any, bad: Callable[[str, str], None]) -> None:
    """Call ``bad("quantization", why)`` for a method that is unknown, contradicts the
    checkpoint, or is combined with what it does not run with (tensor parallelism, LoRA,
    mixture-of-experts models). Runs after ``check_lora`` (which sets ``enable_lora``)."""
    try:
        with open(os.path.join(c.model_path, "config.json")) as f:
            hf_config = json.load(f)
        method = resolve_method(c.quantization, hf_config)
    except (OSError, ValueError) as e:
        bad("quantization", str(e).removeprefix("--quantization "))
        return
    if method is None:
        return
    if c.tp_size > 1:
        bad("quantization", f"{method!r} is not implemented with tp_size > 1")
    if c.enable_lora or c.lora_paths:
        bad("quantization", f"{method!r} is not implemented with LoRA adapters "
            "(enable_lora / lora_paths)")
    if hf_config.get("num_experts"):   # models/moe.py's test for an MoE checkpoint
        bad("quantization", f"{method!r} is not implemented for mixture-of-experts models")
