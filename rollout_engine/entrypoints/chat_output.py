"""One chat choice's output text -> its OpenAI message (``content``, ``reasoning_content``,
``tool_calls``) or its stream deltas, under the server's ``--reasoning-parser`` and
``--tool-call-parser`` (``rollout_engine/parsers``) and the request's ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``separate_reasoning`` and ``stream_reasoning``.

The think block is split off first; the rest is parsed for tool calls when the request has
active tools (without ``--tool-call-parser``: ``<tool_call>`` blocks). A whole output and a
stream go through the same parsers, so they agree however the stream was cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rollout_engine.entrypoints.openai_protocol import ChatCompletionRequest
from rollout_engine.parsers import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
    ToolCallStream,
    tool_call_stream,
)

__all__ = ["ChatOutput", "ChatParsing"]


@dataclass(frozen=True)
class ChatParsing:
    """What is parsed out of one request's outputs."""

    reasoning: Optional[ReasoningFormat] = None    # None: the think block is not split off
    thinking: bool = False                         # outputs start inside the think block
    stream_reasoning: bool = True
    tool_parser: Optional[str] = None              # --tool-call-parser
    tool_names: Optional[tuple[str, ...]] = None   # None: no tool parsing (no active tools)
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest, tool_call_parser: Optional[str],
           reasoning_parser: Optional[str], prompt: str = "") -> ChatParsing:
        """For ``req`` rendered to ``prompt`` on a server with these parsers. Under a grammar
        (which applies from the first token) outputs start outside the think block; an
        opening tag still opens one."""
        fmt = (REASONING_FORMATS[reasoning_parser.lower()]
               if reasoning_parser and req.separate_reasoning else None)
        thinking = (fmt is not None and req.constraint() is None
                    and fmt.thinking(req.template_kwargs, prompt))
        tools = req.active_tools
        return cls(fmt, thinking, req.stream_reasoning, tool_call_parser,
                   tuple(t.function.name for t in tools) if tools else None,
                   req.parallel_tool_calls)

    def output(self) -> ChatOutput:
        """A fresh parser for one choice."""
        reasoning = (ReasoningStream(self.reasoning, self.thinking, self.stream_reasoning)
                     if self.reasoning is not None else None)
        tools = (tool_call_stream(self.tool_parser, self.tool_names, self.parallel)
                 if self.tool_names is not None else None)
        return ChatOutput(reasoning, tools)


class ChatOutput:
    """The parsers of one choice: ``feed`` streamed text, get OpenAI deltas (never empty);
    ``finish`` when it ends; or ``message`` for a whole output."""

    def __init__(self, reasoning: Optional[ReasoningStream],
                 tools: Optional[ToolCallStream]) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.feed(text)
        return self._deltas(reasoning, self._content(content))

    def finish(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            deltas = self._deltas(reasoning, self._content(content))
        if self.tools is not None:
            deltas += self.tools.finish()
        return deltas

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole output: ``content`` (stripped, or None when only
        calls are left, once there are tool calls), ``tool_calls`` when there are any,
        ``reasoning_content`` (or None) when the think block is split off."""
        deltas = self.feed(text) + self.finish()
        content = "".join(d.get("content", "") for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = self.tools.calls if self.tools is not None else []
        if calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = [c.to_openai() for c in calls]
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(
                d.get("reasoning_content", "") for d in deltas) or None
        return message

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self.tools.feed(text)
        return [{"content": text}] if text else []

    @staticmethod
    def _deltas(reasoning: str, content: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return ([{"reasoning_content": reasoning}] if reasoning else []) + content
