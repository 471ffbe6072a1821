"""vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``) as this engine's
one grammar constraint. TRL's ``VLLMClient`` sends ``{"regex": ...}`` for
``structured_outputs_regex`` (``GRPOConfig.vllm_structured_outputs_regex``), on
``/v1/completions`` and ``/v1/chat/completions`` alike.

    json            -> json_schema        regex          -> regex
    choice [a, b]   -> regex (a|b)        grammar        -> ebnf
    json_object     -> json_object        structural_tag -> structural_tag

One of them per request; the options (``disable_any_whitespace``,
``disable_additional_properties``, ``whitespace_pattern``) only at their defaults, else a
ValueError naming the key.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from rollout_engine.constrained.spec import Constraint, make_constraint

__all__ = ["structured_outputs_constraint"]

# vLLM's StructuredOutputsParams: the keys that pick a grammar, and the options (key: default)
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "regex", "grammar": "ebnf",
          "json_object": "json_object", "structural_tag": "structural_tag"}
_OPTIONS: dict[str, Any] = {"disable_any_whitespace": False,
                            "disable_additional_properties": False, "whitespace_pattern": None}


def structured_outputs_constraint(spec: Optional[dict[str, Any]]) -> Optional[Constraint]:
    """The grammar a ``structured_outputs`` object names (None: none); ValueError naming the
    key when it names two, or sets an option this server does not honour."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError("structured_outputs: must be an object")
    picked = [k for k in _KINDS if spec.get(k) not in (None, False)]
    for key, value in spec.items():
        if key in _KINDS:
            continue
        if key not in _OPTIONS:
            raise ValueError(f"structured_outputs.{key}: unknown key; vLLM's keys are "
                             f"{', '.join([*_KINDS, *_OPTIONS])}")
        if value is not None and value != _OPTIONS[key]:
            raise ValueError(f"structured_outputs.{key}: is not supported by this engine; "
                             f"send null or {_OPTIONS[key]!r}")
    if len(picked) > 1:
        raise ValueError(f"structured_outputs: names {' and '.join(picked)}; give one of them")
    if not picked:
        return None
    key = picked[0]
    field = f"structured_outputs.{key}"
    value = spec[key]
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise ValueError(f"{field}: must be a non-empty list of strings")
        value = "(" + "|".join(re.escape(c) for c in value) + ")"
    if key == "json_object" and value is not True:
        raise ValueError(f"{field}: must be true or null")
    return make_constraint(_KINDS[key], value, field)
