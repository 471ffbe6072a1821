"""Parsers of model output text, pure functions of the text (no engine imports): the tool-call
formats of SGLang's ``--tool-call-parser`` (``tool_calls.py``) and the reasoning formats of its
``--reasoning-parser`` (``reasoning.py``). This module names them: which of SGLang's parser
names this engine implements, and the refusal for the ones it does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from rollout_engine.parsers.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
    split_reasoning,
)
from rollout_engine.parsers.tool_calls import (
    Llama3CallStream,
    TaggedCallStream,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    tool_call_constraint,
)

__all__ = ["DEFAULT_TOOL_FORMAT", "REASONING_FORMATS", "SGLANG_REASONING_PARSERS",
           "SGLANG_TOOL_CALL_PARSERS", "TOOL_CALL_FORMATS", "ReasoningFormat",
           "ReasoningStream", "ToolCall", "ToolCallStream", "parse_tool_calls",
           "reasoning_parser_problem", "split_reasoning", "tool_call_constraint",
           "tool_call_parser_problem", "tool_call_stream", "tool_format"]

# --tool-call-parser name -> format (tool_calls.py)
TOOL_CALL_FORMATS: dict[str, str] = {"qwen": "tagged", "qwen25": "tagged", "hermes": "tagged",
                                     "llama3": "llama3"}
# the format chat output is parsed in when tools are given and no parser is configured
DEFAULT_TOOL_FORMAT = "tagged"
_STREAMS: dict[str, type[ToolCallStream]] = {"tagged": TaggedCallStream,
                                             "llama3": Llama3CallStream}

# every name SGLang's FunctionCallParser / ReasoningParser take (python/sglang/srt/
# function_call/function_call_parser.py, parser/reasoning_parser.py)
SGLANG_TOOL_CALL_PARSERS = frozenset(
    "apertus2509 cohere_command4 deepseekv3 deepseekv31 deepseekv32 deepseekv4 dots glm glm45 "
    "glm47 gpt-oss k2_horizon kimi_k2 kimi_k3 lfm2 ling3 llama3 mimo minicpm5 mistral muse "
    "poolside_v1 pythonic qwen qwen25 qwen3_coder spark25 step3 step3p5 minimax-m2 minimax-m3 "
    "trinity interns1 hermes hunyuan gigachat3 gigachat35 gemma4 inkling".split())
SGLANG_REASONING_PARSERS = frozenset(
    "apertus2509 deepseek-r1 deepseek-v3 deepseek-v4 glm45 hunyuan gpt-oss kimi kimi_k2 kimi_k3 "
    "mimo poolside_v1 qwen3 qwen3-thinking minimax minimax-append-think minimax-m3 step3 "
    "step3p5 mistral nemotron_3 interns1 gemma4 inkling cohere_command4 telechat4".split())


def _problem(kind: str, name: str, ours: Iterable[str], sglangs: frozenset[str]) -> str:
    known = ("is one of SGLang's parsers that this engine does not implement"
             if name in sglangs else "is not a parser SGLang or this engine knows")
    return f"{name!r} {known}; the {kind} parsers implemented: {', '.join(sorted(ours))}"


def tool_call_parser_problem(name: Optional[str]) -> Optional[str]:
    """Why ``--tool-call-parser name`` is refused (None: it is accepted)."""
    if name is None or name in TOOL_CALL_FORMATS:
        return None
    return _problem("tool-call", name, TOOL_CALL_FORMATS, SGLANG_TOOL_CALL_PARSERS)


def reasoning_parser_problem(name: Optional[str]) -> Optional[str]:
    """Why ``--reasoning-parser name`` is refused (None: accepted; SGLang ignores case)."""
    if name is None or name.lower() in REASONING_FORMATS:
        return None
    return _problem("reasoning", name, REASONING_FORMATS, SGLANG_REASONING_PARSERS)


def tool_call_stream(parser: Optional[str], tool_names: Optional[Iterable[str]] = None,
                     parallel: bool = True) -> ToolCallStream:
    """A fresh incremental parser for ``--tool-call-parser parser`` (None: the default
    format, ``<tool_call>`` blocks)."""
    fmt = DEFAULT_TOOL_FORMAT if parser is None else TOOL_CALL_FORMATS[parser]
    return _STREAMS[fmt](tool_names, parallel)


def tool_format(parser: Optional[str]) -> str:
    """The format name (``tagged`` / ``llama3``) a parser name stands for."""
    return DEFAULT_TOOL_FORMAT if parser is None else TOOL_CALL_FORMATS[parser]
