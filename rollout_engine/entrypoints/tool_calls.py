"""Tool calls in the Qwen / Hermes format: OpenAI ``tools`` / ``tool_choice`` in, ``tool_calls`` out.

The model writes each call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``parse_tool_calls`` splits a finished output into its text and its calls; ``ToolCallStream``
does the same on streamed text, as OpenAI deltas (text is held back only while it could still be
the start of ``<tool_call>``; a call is sent whole once its ``</tool_call>`` arrives). A block
that is not valid JSON with a known name stays text, as SGLang leaves it. ``tool_choice``
``"required"`` or a named function becomes ``tool_call_constraint``: an xgrammar structural
tag that admits only calls of the allowed tools with arguments valid for their schemas.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.constrained.spec import Constraint, make_constraint

__all__ = ["TOOL_CALL_BEGIN", "TOOL_CALL_END", "ToolCall", "ToolCallStream", "parse_tool_calls",
           "tool_call_constraint"]

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _parse_block(body: str, names: Optional[set[str]]) -> Optional[ToolCall]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):        # some templates send arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, tool_names: Optional[Iterable[str]] = None,
                     parallel: bool = True) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` of a finished output: the text outside the call blocks (stripped;
    None when nothing is left) and the calls in order (only the first unless ``parallel``)."""
    stream = ToolCallStream(tool_names, parallel)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas).strip()
    return (content or None), stream.calls


class ToolCallStream:
    """Incremental parser: ``feed`` streamed text, get OpenAI ``delta`` dicts back."""

    def __init__(self, tool_names: Optional[Iterable[str]] = None, parallel: bool = True) -> None:
        self.names = set(tool_names) if tool_names is not None else None
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
                self._in_call = False
                call = _parse_block(body, self.names)
                if call is None:
                    out.append({"content": TOOL_CALL_BEGIN + body + TOOL_CALL_END})
                elif self.parallel or not self.calls:
                    out.append({"tool_calls": [call.to_openai(len(self.calls))]})
                    self.calls.append(call)
                continue
            start = self._buf.find(TOOL_CALL_BEGIN)
            if start >= 0:
                if start:
                    out.append({"content": self._buf[:start]})
                self._buf = self._buf[start + len(TOOL_CALL_BEGIN):]
                self._in_call = True
                continue
            keep = _partial_prefix(self._buf, TOOL_CALL_BEGIN)
            ready = self._buf[:len(self._buf) - keep]
            if ready:
                out.append({"content": ready})
            self._buf = self._buf[len(ready):]
            return out

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: whatever is held back (an unfinished block) is text."""
        rest = (TOOL_CALL_BEGIN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [{"content": rest}] if rest else []


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _function(tool: Any) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool (a dict or a model with ``model_dump``)."""
    d = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else dict(tool)
    return d.get("function", d)


def tool_call_constraint(tools: Sequence[Any], tool_choice: Any, parallel: bool = True,
                         field: str = "tool_choice") -> Optional[Constraint]:
    """The grammar ``tool_choice`` needs: None for ``"auto"`` / ``"none"``; for ``"required"``
    one or more calls of any tool, for ``{"type": "function", "function": {"name": ...}}`` of
    that one (ValueError naming the field if it is not in ``tools``)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = [_function(t) for t in tools]
    if not functions:
        raise ValueError(f"{field}: {json.dumps(tool_choice)[:60]} needs tools")
    if tool_choice != "required":
        choice = tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else tool_choice
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise ValueError(f"{field}: function {name!r} is not one of the tools")
    tags = [{"type": "tag",
             "begin": f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
             "content": {"type": "json_schema",
                         "json_schema": f.get("parameters") or {"type": "object"}},
             "end": f"}}\n{TOOL_CALL_END}"} for f in functions]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": not parallel}
    return make_constraint("structural_tag", {"type": "structural_tag", "format": fmt}, field)
