"""The --tool-call-parser formats: Llama 3's JSON calls parsed like SGLang's llama3 parser, both
formats streamed at every character boundary to the finished parse, and which parser names are
accepted (the rest refused naming the implemented ones)."""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest

from rollout_engine.parsers import (
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    TOOL_CALL_FORMATS,
    parse_tool_calls,
    reasoning_parser_problem,
    tool_call_parser_problem,
    tool_call_stream,
)
from rollout_engine.parsers.tool_calls import PYTHON_TAG

NAMES = ["get_weather", "time_in"]
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
CLOCK = '{"name": "time_in", "arguments": {"zone": 1}}'


def _parse(parser: str, text: str, parallel: bool = True
           ) -> tuple[Optional[str], list[tuple[str, Any]]]:
    content, calls = parse_tool_calls(text, stream=tool_call_stream(parser, NAMES, parallel))
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (WEATHER, None, [("get_weather", {"city": "Paris"})]),                 # output starts with {
    (f"  {WEATHER}; {CLOCK}", None, [("get_weather", {"city": "Paris"}), ("time_in", {"zone": 1})]),
    (f"Let me check.{PYTHON_TAG}{CLOCK}", "Let me check.", [("time_in", {"zone": 1})]),
    (f"{PYTHON_TAG}{WEATHER};{CLOCK} and done", "and done",
     [("get_weather", {"city": "Paris"}), ("time_in", {"zone": 1})]),
    ('{"name": "time_in", "parameters": "{\\"zone\\": 3}"}', None, [("time_in", {"zone": 3})]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),                                 # JSON, not a call
    ('{"name": "launch_rocket", "parameters": {}}', '{"name": "launch_rocket", "parameters": {}}',
     []),                                                                   # unknown tool
    (f"{PYTHON_TAG}not json", f"{PYTHON_TAG}not json", []),
    ('{"name": "time_in", "parameters": {"zo', '{"name": "time_in", "parameters": {"zo', []),
    (f"{WEATHER}; {{broken", "; {broken", [("get_weather", {"city": "Paris"})]),
], ids=["bare", "two", "tag-after-text", "tag-then-text", "args-as-text", "plain", "json",
        "unknown", "tag-no-json", "cut-short", "call-then-garbage"])
def test_llama3_finished_output(text: str, content: Optional[str], calls: list[Any]) -> None:
    assert _parse("llama3", text) == (content, calls)


def test_llama3_parallel_false_keeps_the_first_call() -> None:
    assert _parse("llama3", f"{WEATHER}; {CLOCK}", parallel=False) == (
        None, [("get_weather", {"city": "Paris"})])


TAGGED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
STREAMED = [("qwen25", TAGGED), ("hermes", TAGGED + " tail <tool_ca"), ("llama3", WEATHER),
            ("llama3", f"Let me check.{PYTHON_TAG}{WEATHER}; {CLOCK} done"),
            ("llama3", f"plain text with a {PYTHON_TAG[:5]} in it"),
            ("llama3", f"  {PYTHON_TAG}{{\"name\": 7}}")]


@pytest.mark.parametrize("parser, text", STREAMED,
                         ids=[f"{p}-{k}" for k, (p, _) in enumerate(STREAMED)])
def test_streamed_at_every_cut_equals_the_finished_parse(parser: str, text: str) -> None:
    """One character at a time, and every split into two pieces: no empty delta, the content
    joins to the finished parse's, each call arrives whole, in order, with its index."""
    want_content, want_calls = _parse(parser, text)
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(len(text) + 1)]
    for chunks in splits:
        stream = tool_call_stream(parser, NAMES)
        deltas = [d for c in chunks for d in stream.feed(c)] + stream.finish()
        assert all(d.get("content", "x") and len(d) == 1 for d in deltas), chunks
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert (content.strip() or None) == want_content, chunks
        assert [c["index"] for c in calls] == list(range(len(want_calls)))
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == want_calls


def test_llama3_holds_back_only_what_could_be_the_tag() -> None:
    stream = tool_call_stream("llama3", NAMES)
    assert stream.feed("  ") == []                     # an output may still open with {
    assert stream.feed("Sure, <|pyt") == [{"content": "  Sure, "}]
    assert stream.feed("hon") == []
    assert stream.feed("_tags|> no") == [{"content": "<|python_tags|> no"}]


# -- which names are accepted -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen", "qwen25", "hermes", "llama3", None])
def test_implemented_tool_call_parsers(name: Optional[str]) -> None:
    assert tool_call_parser_problem(name) is None


@pytest.mark.parametrize("name", ["deepseek-r1", "DeepSeek-R1", "qwen3", "qwen3-thinking",
                                  "step3", "step3p5", "interns1", "minimax", None])
def test_implemented_reasoning_parsers(name: Optional[str]) -> None:
    assert reasoning_parser_problem(name) is None


def test_sglangs_other_parsers_are_refused_naming_ours() -> None:
    """The names slime and miles launch with that are not implemented (qwen3_coder, glm47,
    glm45) say so and list what is."""
    problem = tool_call_parser_problem("qwen3_coder")
    assert problem == ("'qwen3_coder' is one of SGLang's parsers that this engine does not "
                       "implement; the tool-call parsers implemented: hermes, llama3, qwen, "
                       "qwen25")
    assert "is one of SGLang's parsers" in str(tool_call_parser_problem("glm47"))
    problem = reasoning_parser_problem("glm45")
    assert problem is not None and problem.endswith(
        "the reasoning parsers implemented: deepseek-r1, interns1, minimax, qwen3, "
        "qwen3-thinking, step3, step3p5")
    assert "is not a parser SGLang or this engine knows" in str(tool_call_parser_problem("qwen9"))
    assert set(TOOL_CALL_FORMATS) <= SGLANG_TOOL_CALL_PARSERS
    assert {"deepseek-r1", "qwen3", "qwen3-thinking"} <= SGLANG_REASONING_PARSERS
