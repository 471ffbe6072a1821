"""The model's own sampling defaults: what SGLang's ``--sampling-defaults model`` takes from a
model directory's ``generation_config.json`` for the chat requests that omit a field.

No imports from the engine beyond ``SamplingParams`` (which checks the values).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rollout_engine.sampling_params import SamplingParams

__all__ = ["SAMPLING_KEYS", "read_sampling_defaults"]

# the generation_config.json keys SGLang reads (ModelConfig.get_default_sampling_params)
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


def read_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The ``SAMPLING_KEYS`` that ``model_path/generation_config.json`` sets (null counts as
    unset), under ``SamplingParams``' names. ``do_sample: false`` means greedy decoding
    (temperature 0), as SGLang reads it; Hugging Face's ``top_k: 0`` (no top-k filter) is -1
    here. No file: ``{}``. A file that is not a JSON object, or a value ``SamplingParams``
    refuses, is a ValueError naming the file and the key."""
    path = os.path.join(str(model_path), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object")
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if defaults.get("top_k") == 0 and type(defaults["top_k"]) is int:
        defaults["top_k"] = -1
    try:
        SamplingParams.from_dict(dict(defaults))
    except ValueError as e:
        raise ValueError(f"{path}: {str(e).replace('sampling_params.', '', 1)}") from None
    return defaults
