"""Per-request sampling options, validated at the edge (``ValueError`` naming the field)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from rollout_engine.compat.fields import SAMPLING_PARAMS, Treatment
from rollout_engine.constrained.spec import Constraint, constraint_from_params

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "no_stop_trim", "return_masked_logprobs")
_JSON_FIELDS = ("json_schema", "structural_tag")   # a JSON string, or an object (kept as text)
_TEXT_FIELDS = ("regex", "ebnf")


@dataclass
class SamplingParams:
    """SGLang-compatible sampling parameters.

    Returned logprobs never depend on these filters: each is ``log_softmax(logits / T)`` over the
    full vocabulary (``T = 1`` for greedy), before penalties and top-k / top-p / min-p truncation,
    which is what a trainer recomputes from the same weights.

    ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag`` (at most one; ``constraint``
    says which) constrain the output to a grammar; ``verify`` checks their syntax, the request
    builder's ``grammar_check`` what the grammar backend accepts. Under a grammar the returned
    logprobs stay unmasked unless ``return_masked_logprobs`` (log_softmax over the allowed
    tokens: the distribution actually sampled).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    # our extension (SGLang has none): under a grammar, return log_softmax over the allowed
    # tokens (the sampled distribution) instead of the unmasked log_softmax(logits / T)
    return_masked_logprobs: bool = False
    # SGLang's arguments of a custom logit processor (which is refused): only
    # ``return_top_p_token_ids`` is read (``Req.top_p_kept``), the rest reach nothing
    custom_params: Optional[dict[str, Any]] = None

    @property
    def return_top_p_token_ids(self) -> bool:
        """meta_info.top_p_token_ids / top_p_token_offsets: the ids each output token's
        sampling kept (its top-k / top-p / min-p nucleus), for a trainer to renormalise over."""
        return bool((self.custom_params or {}).get("return_top_p_token_ids"))

    @classmethod
    def from_dict(cls, d: Optional[Union[dict[str, Any], SamplingParams]]) -> SamplingParams:
        """Parse a JSON-style dict; ``None`` values mean the default.

        Every field of SGLang's ``SamplingParams`` is accepted (``compat/fields.py`` says how
        each is treated): a non-default value of one we lack (``logit_bias``, ``stop_regex``,
        ...) is a ValueError naming it, as is a name SGLang does not know.
        """
        if d is None:
            d = {}
        if isinstance(d, SamplingParams):
            return dataclasses.replace(d)
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        SAMPLING_PARAMS.check(d, "sampling_params", prefix="sampling_params.")
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            if v is None or k not in _SUPPORTED:
                continue
            kwargs[k] = _coerce(k, v)
        sp = cls(**kwargs)
        sp.verify()
        return sp

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Check ranges; raise ValueError naming the field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"sampling_params.{name}: {why}")

        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (all) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            bad("sampling_seed", "must be in [0, 2**63)")
        for s in self.stop:
            if not s:
                bad("stop", "stop strings must be non-empty")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"token id {t} outside the vocabulary [0, {vocab_size})")
        _ = self.constraint   # one constraint at most, each well-formed

    @property
    def constraint(self) -> Optional[Constraint]:
        """The grammar this request asks for (None: unconstrained); ValueError naming the
        field(s) when two are given or one is malformed."""
        return constraint_from_params({k: getattr(self, k) for k in _CONSTRAINT_FIELDS})

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SUPPORTED = SAMPLING_PARAMS.names(Treatment.SUPPORTED)
MAX_CUSTOM_PARAMS = 4096
_CONSTRAINT_FIELDS = (*_JSON_FIELDS, *_TEXT_FIELDS)


def _coerce(name: str, v: Any) -> Any:
    """JSON values to field types; bools are not numbers here, and floats are not ints."""
    if name in _INT_FIELDS:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v)
            raise ValueError(f"sampling_params.{name}: must be an integer, got {v!r}")
        return v
    if name in _FLOAT_FIELDS:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"sampling_params.{name}: must be a number, got {v!r}")
        return float(v)
    if name in _BOOL_FIELDS:
        if not isinstance(v, bool):
            raise ValueError(f"sampling_params.{name}: must be a boolean, got {v!r}")
        return v
    if name == "stop":
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return list(v)
        raise ValueError(f"sampling_params.stop: must be a string or a list of strings, got {v!r}")
    if name in _JSON_FIELDS:
        if isinstance(v, (dict, bool)):
            return json.dumps(v, ensure_ascii=False)
        if not isinstance(v, str):
            raise ValueError(f"sampling_params.{name}: must be a JSON string or an object, "
                             f"got {v!r}")
        return v
    if name in _TEXT_FIELDS:
        if not isinstance(v, str):
            raise ValueError(f"sampling_params.{name}: must be a string, got {v!r}")
        return v
    if name == "custom_params":
        if not isinstance(v, dict) or len(json.dumps(v, default=str)) > MAX_CUSTOM_PARAMS:
            raise ValueError("sampling_params.custom_params: must be an object of at most "
                             f"{MAX_CUSTOM_PARAMS} characters of JSON")
        flag = v.get("return_top_p_token_ids", False)
        if not isinstance(flag, bool):
            raise ValueError("sampling_params.custom_params.return_top_p_token_ids: must be "
                             f"a boolean, got {flag!r}")
        return dict(v)
    if name == "stop_token_ids":
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return list(v)
        raise ValueError(f"sampling_params.stop_token_ids: must be a list of integers, got {v!r}")
    return v
