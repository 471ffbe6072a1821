"""Qwen / Hermes tool calls: parsing finished and streamed output into OpenAI tool_calls, and
the grammar that tool_choice "required" / a named function needs, in each --tool-call-parser
format (every output it admits parses into a valid call)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.constrained import XGrammarBackend, check_grammar
from rollout_engine.parsers import tool_call_stream, tool_format
from rollout_engine.parsers.tool_calls import (
    TaggedCallStream,
    parse_tool_calls,
    tool_call_constraint,
)
from tests.rollout_engine.constrained.test_generation import decode, random_logits

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather by city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "time_in", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
NAMES = ["get_weather", "time_in"]

OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "time_in", "arguments": '
          '{"zone": 1}}\n</tool_call>')


def test_parse_finished_output() -> None:
    content, calls = parse_tool_calls(OUTPUT, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("time_in", {"zone": 1})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    d = calls[1].to_openai(1)
    assert d["index"] == 1 and d["type"] == "function" and d["function"]["name"] == "time_in"
    _, first = parse_tool_calls(OUTPUT, NAMES, parallel=False)
    assert [c.name for c in first] == ["get_weather"]


@pytest.mark.parametrize("text", [
    "no calls at all",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "P"</tool_call>',   # bad JSON
    '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',          # unknown name
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',           # not an object
    'cut short <tool_call>{"name": "get_weather", "argu',                          # unfinished
])
def test_what_is_not_a_call_stays_text(text: str) -> None:
    content, calls = parse_tool_calls(text, NAMES)
    assert calls == [] and content == text.strip()


def test_arguments_as_json_text_and_parameters_key() -> None:
    text = ('<tool_call>{"name": "time_in", "arguments": "{\\"zone\\": 3}"}</tool_call>'
            '<tool_call>{"name": "time_in", "parameters": {"zone": 4}}</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"zone": 3},
                                                                             {"zone": 4}]


def _stream(text: str, cuts: list[int]) -> list[dict[str, Any]]:
    parser = TaggedCallStream(NAMES)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas: list[dict[str, Any]] = []
    for a, b in zip(bounds, bounds[1:]):
        deltas += parser.feed(text[a:b])
    return deltas + parser.finish()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12),
       text=st.sampled_from([OUTPUT, OUTPUT + " done", "plain <tool text", "a <tool_call>b",
                             "x" + OUTPUT.split("\n", 1)[1]]))
def test_streaming_equals_the_finished_parse(cuts: list[int], text: str) -> None:
    """However the text is cut into deltas, the content joins to the same text and the calls
    arrive whole, in order, with their index; no delta is empty."""
    deltas = _stream(text, cuts)
    assert all(d.get("content", "x") and set(d) <= {"content", "tool_calls"} for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    want_content, want_calls = parse_tool_calls(text, NAMES)
    assert (content.strip() or None) == want_content
    assert [c["index"] for c in calls] == list(range(len(want_calls)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c.name, c.arguments) for c in want_calls]


def test_no_text_is_held_back_longer_than_needed() -> None:
    parser = TaggedCallStream(NAMES)
    assert parser.feed("hello <tool") == [{"content": "hello "}]
    assert parser.feed("box>") == [{"content": "<toolbox>"}]


def test_auto_and_none_need_no_grammar() -> None:
    assert tool_call_constraint(TOOLS, "auto") is None
    assert tool_call_constraint(TOOLS, "none") is None
    assert tool_call_constraint(TOOLS, None) is None


def test_bad_choices_are_named() -> None:
    with pytest.raises(ValueError, match="^tool_choice: .*needs tools"):
        tool_call_constraint([], "required")
    with pytest.raises(ValueError, match="^tool_choice: function 'nope' is not one of the tools"):
        tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("choice, allowed", [
    ("required", set(NAMES)),
    ({"type": "function", "function": {"name": "time_in"}}, {"time_in"}),
], ids=["required", "named"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("parser", ["qwen25", "llama3"])
def test_forced_calls_always_parse(backend: XGrammarBackend, tokenizer: Any, choice: Any,
                                   allowed: set[str], greedy: bool, parser: str) -> None:
    """The grammar of a forcing tool_choice, in the server's format, admits only outputs that
    format's parser reads back as one valid call."""
    c = tool_call_constraint(TOOLS, choice, parallel=False, fmt=tool_format(parser))
    assert c is not None and c.kind == "structural_tag"
    check_grammar(c)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for text in decode(backend, tokenizer, c.kind, c.spec, random_logits(11), greedy, 11):
        content, calls = parse_tool_calls(
            text, stream=tool_call_stream(parser, NAMES, parallel=False))
        assert content is None and len(calls) == 1, text
        assert calls[0].name in allowed
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
