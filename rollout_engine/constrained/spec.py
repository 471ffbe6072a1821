"""What a request asks a grammar for: ``Constraint`` (kind, spec), checked without xgrammar.

SGLang's ``sampling_params`` carry at most one of ``json_schema``, ``regex``, ``ebnf`` and
``structural_tag``; the OpenAI layer adds ``json_object`` (any JSON; SGLang spells it
``json_schema="$$ANY$$"``, which is accepted too). ``constraint_from_params`` turns those
fields into one ``Constraint`` whose ``spec`` is canonical text: together with ``kind`` it is
the compile-cache key. Everything here is pure Python and cheap (a ``json.loads`` at most), so
it runs at request submission; the deeper, still tokenizer-free check of what xgrammar accepts
is ``backend.check_grammar``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ANY_JSON", "CONSTRAINT_FIELDS", "KINDS", "Constraint", "constraint_from_params",
           "make_constraint"]

# the sampling_params names, in SGLang's order; json_object is the OpenAI layer's kind
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
KINDS = (*CONSTRAINT_FIELDS, "json_object")
ANY_JSON = "$$ANY$$"   # SGLang's json_schema value for "any JSON" (response_format json_object)


@dataclass(frozen=True)
class Constraint:
    """One grammar request: ``kind`` in ``KINDS`` and its canonical ``spec`` text.

    ``field`` is the name the client used (``sampling_params.json_schema``, ``response_format``),
    for error messages only; it is not part of the cache key.
    """

    kind: str
    spec: str
    field: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)

    @property
    def name(self) -> str:
        return self.field or self.kind


def constraint_from_params(params: Mapping[str, Any], prefix: str = "sampling_params."
                           ) -> Optional[Constraint]:
    """The constraint of one request's fields (``None``: unconstrained).

    Raises ValueError naming the field: two constraints on one request (both named), a value
    of the wrong type, a schema or structural tag that is not JSON of the right shape.
    """
    given = [k for k in CONSTRAINT_FIELDS if params.get(k) is not None]
    if len(given) > 1:
        names = " and ".join(prefix + k for k in given)
        raise ValueError(f"{names}: a request takes one constraint (json_schema, regex, ebnf "
                         f"or structural_tag); give only one")
    if not given:
        return None
    kind = given[0]
    return make_constraint(kind, params[kind], prefix + kind)


def make_constraint(kind: str, value: Any, field: str = "") -> Constraint:
    """Check ``value`` for ``kind`` and canonicalize it; ValueError names ``field``."""
    field = field or kind
    if kind not in KINDS:
        raise ValueError(f"{field}: unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "json_object":
        return Constraint("json_object", "", field)
    if kind in ("regex", "ebnf"):
        if not isinstance(value, str):
            raise ValueError(f"{field}: must be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{field}: must not be empty")
        return Constraint(kind, value, field)
    if kind == "json_schema" and value == ANY_JSON:
        return Constraint("json_object", "", field)
    obj = _json_value(value, field)
    if kind == "json_schema":
        if not isinstance(obj, (dict, bool)):
            raise ValueError(f"{field}: a JSON schema must be an object (or true / false), "
                             f"got {type(obj).__name__}")
    else:
        _check_structural_tag(obj, field)
    # key order is kept: xgrammar emits properties in schema order
    return Constraint(kind, json.dumps(obj, ensure_ascii=False, separators=(",", ":")), field)


def _json_value(value: Any, field: str) -> Any:
    if isinstance(value, (dict, bool)):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{field}: must be a JSON string or an object, got "
                         f"{type(value).__name__}")
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None


def _check_structural_tag(obj: Any, field: str) -> None:
    """Either SGLang's legacy ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
    (``type`` optional) or xgrammar's ``{"format": {...}}``; the format's inside is xgrammar's
    to check (``backend.check_grammar``)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{field}: a structural tag must be an object, got {type(obj).__name__}")
    if obj.get("structures") is not None:
        structures, triggers = obj["structures"], obj.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise ValueError(f"{field}.structures: must be a non-empty list")
        if not isinstance(triggers, list) or not triggers or not all(
                isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{field}.triggers: must be a non-empty list of non-empty strings "
                             "(the legacy form needs structures and triggers)")
        for i, s in enumerate(structures):
            where = f"{field}.structures[{i}]"
            if not isinstance(s, dict):
                raise ValueError(f"{where}: must be an object with begin, schema and end")
            for key in ("begin", "end"):
                if not isinstance(s.get(key), str):
                    raise ValueError(f"{where}.{key}: must be a string")
            schema = s.get("schema", s.get("parameters"))
            if schema is not None and not isinstance(schema, (dict, bool)):
                raise ValueError(f"{where}.schema: must be a JSON schema object")
            if not any(s["begin"].startswith(t) for t in triggers):
                raise ValueError(f"{where}.begin: {s['begin']!r} starts with none of the "
                                 f"triggers {triggers}")
        return
    if obj.get("format") is None:
        raise ValueError(f"{field}: needs either structures + triggers (SGLang's legacy form) "
                         "or format (xgrammar's structural tag)")
    if not isinstance(obj["format"], dict):
        raise ValueError(f"{field}.format: must be an object, got "
                         f"{type(obj['format']).__name__}")
