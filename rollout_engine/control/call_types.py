"""Control-call arguments coerced to the handlers' declared types, as SGLang's request models
coerce an HTTP body.

SGLang validates each control route's JSON body with pydantic in its lax mode (its ``*ReqInput``
structs carry a pydantic schema: ``msgspec_struct_pydantic_core_schema``), so a trainer may send
``"master_port": "29500"`` (AReaL does) or ``"flush_cache": "false"``. ``coerce_call`` applies
the same rules to a call's keyword arguments, one place for every control route, with the types
read from the handler's signature (``handlers.declared_calls``; ``**sglang_flags`` is typed by
``compat.update_requests``):

    int     "29500" -> 29500 (surrounding spaces too), 1.0 -> 1, true -> 1;
            "abc", "1e3", 1.5 refused
    float   "1.5" -> 1.5, 3 -> 3.0;  "x" refused
    bool    "true" / "false", "yes" / "no", "on" / "off", "1" / "0", 1 / 0;  "maybe", 2 refused
    str     only strings (5 is refused, as SGLang refuses it)
    lists   element by element (``shapes: [["2", "3"]]`` -> ``[[2, 3]]``); a tuple is a list

A value that does not coerce is a ``ValueError`` naming the call and the field. A name the
handler does not declare, or declares without a type, passes unchanged (the routes decide which
names a body may carry).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Mapping
from typing import Any, Optional

import pydantic

from rollout_engine.control.handlers import declared_calls

__all__ = ["coerce_call", "declared_types"]


@functools.cache
def declared_types(method: str) -> Mapping[str, Any]:
    """``method``'s arguments and their declared types (empty for an unknown call)."""
    handler = declared_calls().get(method)
    if handler is None:
        return {}
    hints = typing.get_type_hints(handler)
    types: dict[str, Any] = {}
    for name, param in inspect.signature(handler).parameters.items():
        hint = hints.get(name)
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if typing.get_origin(hint) is typing.Unpack:
                types.update(typing.get_type_hints(typing.get_args(hint)[0]))
        elif name != "self" and hint is not None and hint is not Any:
            types[name] = hint
    return types


@functools.cache
def _adapter(hint: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(hint)


def coerce_call(method: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every declared argument coerced as SGLang's pydantic models would."""
    types = declared_types(method)
    out = dict(kwargs)
    for name, value in kwargs.items():
        hint = types.get(name)
        if hint is None:
            continue
        try:
            out[name] = _adapter(hint).validate_python(value)
        except pydantic.ValidationError as e:
            raise ValueError(f"{method}: {name}: {_reason(e)}, got {_short(value)}") from None
    return out


def _reason(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    msg: Optional[str] = first.get("msg")
    return f"{msg} (at {where})" if where else str(msg)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
