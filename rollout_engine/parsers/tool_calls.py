"""Tool calls in model output as OpenAI ``tool_calls``, in the formats SGLang's
``--tool-call-parser`` names; and the grammar a forcing ``tool_choice`` needs.

    tagged   qwen, qwen25, hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   llama3                 [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}

Each format is an incremental parser (a ``ToolCallStream``): ``feed`` it streamed text and get
OpenAI ``delta`` dicts back (``{"content": ...}`` or ``{"tool_calls": [call]}``, never empty),
``finish`` when the output ends. ``parse_tool_calls`` runs the same parser over a finished
output, so a stream and a whole output agree however the text was cut. Text is held back only
while it could still be the start of a call; a call is sent whole once it is complete. What is
not a valid call of a known tool (bad JSON, an unknown name, arguments that are not an object)
stays text. ``tool_choice`` ``"required"`` or a named function becomes
``tool_call_constraint``: an xgrammar structural tag that admits only calls of the allowed tools,
in the format's own shape, with arguments valid for their schemas.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.constrained.spec import Constraint, make_constraint

__all__ = ["PYTHON_TAG", "TOOL_CALL_BEGIN", "TOOL_CALL_END", "Llama3CallStream",
           "TaggedCallStream", "ToolCall", "ToolCallStream", "parse_tool_calls",
           "tool_call_constraint"]

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


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


def _as_call(obj: Any, names: Optional[set[str]]) -> Optional[ToolCall]:
    """A decoded JSON value as a call of a known tool (``arguments`` or ``parameters``, an
    object or JSON text of one), or None."""
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


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream(ABC):
    """An incremental parser of one output. ``tool_names``: the request's tools (None: any
    name); ``parallel``: False keeps only the first call (later ones are dropped)."""

    def __init__(self, tool_names: Optional[Iterable[str]] = None, parallel: bool = True) -> None:
        self.names = set(tool_names) if tool_names is not None else None
        self.parallel = parallel
        self.calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` (the next piece of the output) completes."""

    @abstractmethod
    def finish(self) -> list[dict[str, Any]]:
        """The output ended: whatever is held back (an unfinished call) is text."""

    def _emit(self, call: ToolCall) -> list[dict[str, Any]]:
        if not self.parallel and self.calls:
            return []
        self.calls.append(call)
        return [{"tool_calls": [call.to_openai(len(self.calls) - 1)]}]


class TaggedCallStream(ToolCallStream):
    """Qwen 2.5 / Hermes: each call a JSON object between ``<tool_call>`` and ``</tool_call>``.
    A ``</tool_call>`` inside an argument string ends the block early (the block is then text)."""

    def __init__(self, tool_names: Optional[Iterable[str]] = None, parallel: bool = True) -> None:
        super().__init__(tool_names, parallel)
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
                call = _block_call(body, self.names)
                if call is None:
                    out.append({"content": TOOL_CALL_BEGIN + body + TOOL_CALL_END})
                else:
                    out += self._emit(call)
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
        rest = (TOOL_CALL_BEGIN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [{"content": rest}] if rest else []


def _block_call(body: str, names: Optional[set[str]]) -> Optional[ToolCall]:
    try:
        return _as_call(json.loads(body), names)
    except json.JSONDecodeError:
        return None


class Llama3CallStream(ToolCallStream):
    """Llama 3 JSON calls (SGLang's ``llama3``): an output that starts with ``{`` is calls, and
    so is whatever follows ``<|python_tag|>``; calls are JSON objects separated by ``;``. Text
    before the tag is content; from the first thing that is not a valid call on, the rest is
    content (the tag included when no call preceded it)."""

    def __init__(self, tool_names: Optional[Iterable[str]] = None, parallel: bool = True) -> None:
        super().__init__(tool_names, parallel)
        self._buf = ""
        self._mode = "start"    # start -> text | calls -> rest
        self._tag = ""          # the python tag, until a call shows it opened calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                    return out                       # undecided: blank, or maybe the tag
                self._mode = "calls" if head.startswith("{") else "text"
                continue
            if self._mode == "text":
                at = self._buf.find(PYTHON_TAG)
                if at >= 0:
                    if at:
                        out.append({"content": self._buf[:at]})
                    self._buf, self._tag = self._buf[at + len(PYTHON_TAG):], PYTHON_TAG
                    self._mode = "calls"
                    continue
                keep = _partial_prefix(self._buf, PYTHON_TAG)
                ready = self._buf[:len(self._buf) - keep]
                if ready:
                    out.append({"content": ready})
                self._buf = self._buf[len(ready):]
                return out
            if self._mode == "calls":
                out += self._take_calls()
                if self._mode == "calls":
                    return out
                continue
            if self._buf:                            # rest: plain content
                out.append({"content": self._buf})
                self._buf = ""
            return out

    def _take_calls(self) -> list[dict[str, Any]]:
        """Every complete call at the head of the buffer; an object that is not a call, or
        text that is not an object, turns the rest into content (mode ``rest``)."""
        out: list[dict[str, Any]] = []
        while True:
            body = self._buf.lstrip()
            if self.calls and body.startswith(";"):
                body = body[1:].lstrip()
            if not body:
                return out
            if not body.startswith("{"):
                self._to_rest()
                return out
            if "}" not in body:
                return out                           # no object can be complete yet
            try:
                obj, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                return out                           # maybe unfinished: wait for more
            call = _as_call(obj, self.names)
            if call is None:
                self._to_rest()
                return out
            out += self._emit(call)
            self._buf, self._tag = body[end:], ""

    def _to_rest(self) -> None:
        self._buf, self._tag, self._mode = self._tag + self._buf, "", "rest"

    def finish(self) -> list[dict[str, Any]]:
        rest = self._tag + self._buf
        self._buf, self._tag, self._mode = "", "", "rest"
        return [{"content": rest}] if rest else []


def parse_tool_calls(text: str, tool_names: Optional[Iterable[str]] = None,
                     parallel: bool = True, stream: Optional[ToolCallStream] = None
                     ) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` of a finished output: the text outside the calls (stripped; None
    when nothing is left) and the calls in order (only the first unless ``parallel``).
    ``stream``: a fresh parser of the format to use (default: the tagged format)."""
    parser = stream if stream is not None else TaggedCallStream(tool_names, parallel)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.get("content", "") for d in deltas).strip()
    return (content or None), parser.calls


def _function(tool: Any) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool (a dict or a model with ``model_dump``)."""
    d = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else dict(tool)
    return d.get("function", d)


# (begin before the name, between the name and the arguments, end, separator) per format
_SHAPES = {
    "tagged": (f'{TOOL_CALL_BEGIN}\n{{"name": ', ', "arguments": ', f"}}\n{TOOL_CALL_END}", "\n"),
    "llama3": ('{"name": ', ', "parameters": ', "}", ";"),
}


def tool_call_constraint(tools: Sequence[Any], tool_choice: Any, parallel: bool = True,
                         field: str = "tool_choice", fmt: str = "tagged"
                         ) -> Optional[Constraint]:
    """The grammar ``tool_choice`` needs in format ``fmt`` (tagged or llama3): None for
    ``"auto"`` / ``"none"``; for ``"required"`` one or more calls of any tool, for
    ``{"type": "function", "function": {"name": ...}}`` of that one (ValueError naming the
    field if it is not in ``tools``)."""
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
    begin, middle, end, separator = _SHAPES[fmt]
    tags = [{"type": "tag", "begin": begin + json.dumps(f["name"]) + middle,
             "content": {"type": "json_schema",
                         "json_schema": f.get("parameters") or {"type": "object"}},
             "end": end} for f in functions]
    spec = {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": not parallel}
    return make_constraint("structural_tag", {"type": "structural_tag", "format": spec}, field)
