"""vLLM's extensions of the OpenAI routes that RL clients read (TRL's ``VLLMClient``):

    return_token_ids            completions: choices[i].prompt_token_ids, choices[i].token_ids;
                                chat: the response's prompt_token_ids, choices[i].token_ids
    return_tokens_as_token_ids  logprob entries name tokens "token_id:<id>" (never ambiguous)
    structured_outputs          vLLM's StructuredOutputsParams: json, regex, choice, grammar,
                                json_object, structural_tag (one of them); its options
                                (disable_any_whitespace, ...) only at their defaults
    top_k = 0                   vLLM's "no truncation" (SGLang's -1)

Token ids are the engine's own: the prompt as tokenized (or as given) and every sampled token,
EOS included when it ended the sample.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from rollout_engine.constrained.spec import Constraint, make_constraint
from rollout_engine.entrypoints.token_pieces import TokenPieces

__all__ = ["TokenIdPieces", "structured_outputs_constraint", "vllm_top_k"]

# vLLM's StructuredOutputsParams: the keys that pick a grammar, and the options (key: default)
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "regex", "grammar": "ebnf",
          "json_object": "json_object", "structural_tag": "structural_tag"}
_OPTIONS: dict[str, Any] = {"disable_any_whitespace": False,
                            "disable_additional_properties": False, "whitespace_pattern": None}


class TokenIdPieces(TokenPieces):
    """Logprob entries under ``return_tokens_as_token_ids``: each token shown as
    ``"token_id:<id>"``; its bytes stay the token's own (text offsets count them)."""

    def __init__(self, pieces: TokenPieces) -> None:   # shares the pieces' cache, no re-init
        self.__dict__.update(pieces.__dict__)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        return f"token_id:{token_id}", super().piece(token_id)[1]


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


def vllm_top_k(top_k: Optional[int]) -> Optional[int]:
    """vLLM's ``top_k = 0`` (no truncation) as SGLang's -1; other values as given."""
    return -1 if top_k == 0 else top_k
