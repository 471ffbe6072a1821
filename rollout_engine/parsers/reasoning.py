"""Reasoning split out of model output, as SGLang's ``--reasoning-parser`` splits it: the think
block becomes ``reasoning_content``, the rest ``content``.

    deepseek-r1 (step3, step3p5)   the output starts inside the block (R1's prompt opens it):
                                   reasoning until </think>; a leading <think> is dropped
    qwen3 (interns1)               <think>...</think>; the output starts inside the block when
                                   the request's thinking is on (chat_template_kwargs
                                   enable_thinking is not false, as Qwen3's template reads it)
                                   or the rendered prompt ends with <think>; <tool_call> also
                                   ends the block
    qwen3-thinking (minimax)       always starts inside the block; <tool_call> also ends it

An output has one block: text before an opening tag is content, and so is everything after
the block ends. A block the output never closes (cut short) is all reasoning. The parser is
incremental (``ReasoningStream``); ``split_reasoning`` runs it over a finished output, so both
agree however the text was cut. Text is held back only while it could be the start of a tag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from rollout_engine.parsers.tool_calls import TOOL_CALL_BEGIN

__all__ = ["REASONING_FORMATS", "ReasoningFormat", "ReasoningStream", "split_reasoning"]


@dataclass(frozen=True)
class ReasoningFormat:
    """One format: its tags, whether outputs always start inside the block, the chat template
    argument that turns thinking off (False), and a tag that also ends the block (kept as
    content)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False
    toggle: Optional[str] = None
    tool_start: Optional[str] = None

    def thinking(self, template_kwargs: Mapping[str, Any], prompt: str = "") -> bool:
        """Whether an output starts inside the block, for a request rendered to ``prompt``
        with ``template_kwargs``."""
        if self.always or prompt.rstrip().endswith(self.start):
            return True
        return self.toggle is not None and template_kwargs.get(self.toggle) is not False


_R1 = ReasoningFormat("deepseek-r1", always=True)
_QWEN3 = ReasoningFormat("qwen3", toggle="enable_thinking", tool_start=TOOL_CALL_BEGIN)
_QWEN3_THINKING = ReasoningFormat("qwen3-thinking", always=True, tool_start=TOOL_CALL_BEGIN)
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": _R1, "step3": _R1, "step3p5": _R1,
    "qwen3": _QWEN3, "interns1": _QWEN3,
    "qwen3-thinking": _QWEN3_THINKING, "minimax": _QWEN3_THINKING,
}


def _partial_prefix(text: str, tag: Optional[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    if not tag:
        return 0
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Incremental split of one output into ``(reasoning, content)`` pieces. ``thinking``: the
    output starts inside the block; ``stream_reasoning`` False: the reasoning comes out in one
    piece, when the block ends (or the output does)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool, stream_reasoning: bool = True
                 ) -> None:
        self.fmt = fmt
        self.stream_reasoning = stream_reasoning
        self._state = "inside" if thinking else "before"    # before -> inside -> after
        self._opened = False     # inside: the opening tag was seen, or cannot come any more
        self._buf = ""
        self._held = ""          # reasoning not sent yet (stream_reasoning False)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content ``text`` (the next piece of the output) completes."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return self._release("".join(reasoning)), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: what is held back goes where the parser stands."""
        rest, self._buf = self._buf, ""
        reasoning = rest if self._state == "inside" else ""
        content = "" if self._state == "inside" else rest
        self._state = "after"
        return self._release(reasoning), content

    def _release(self, reasoning: str) -> str:
        if self.stream_reasoning:
            return reasoning
        self._held += reasoning
        if self._state == "inside":
            return ""
        out, self._held = self._held, ""
        return out

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what can be decided; True when the state changed and there may be more."""
        fmt, buf = self.fmt, self._buf
        if self._state == "after":
            content.append(buf)
            self._buf = ""
            return False
        if self._state == "before":
            at = buf.find(fmt.start)
            if at >= 0:
                content.append(buf[:at])
                self._buf = buf[at + len(fmt.start):]
                self._state, self._opened = "inside", True
                return True
            keep = _partial_prefix(buf, fmt.start)
            content.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if not self._opened:
            head = buf.lstrip()
            if fmt.start.startswith(head) and head != fmt.start:
                return False                                 # blank, or maybe the tag
            self._opened = True
            if head.startswith(fmt.start):
                self._buf = head[len(fmt.start):]
            return True
        stops = [(buf.find(fmt.end), len(fmt.end))]
        if fmt.tool_start:
            stops.append((buf.find(fmt.tool_start), 0))      # the call stays content
        found = [(at, skip) for at, skip in stops if at >= 0]
        if found:
            at, skip = min(found)
            reasoning.append(buf[:at])
            self._buf = buf[at + skip:]
            self._state = "after"
            return True
        keep = max(_partial_prefix(buf, fmt.end), _partial_prefix(buf, fmt.tool_start))
        reasoning.append(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False


def split_reasoning(text: str, fmt: ReasoningFormat, thinking: bool
                    ) -> tuple[Optional[str], str]:
    """``(reasoning, content)`` of a finished output (reasoning None when there is none)."""
    stream = ReasoningStream(fmt, thinking)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, c1 + c2
