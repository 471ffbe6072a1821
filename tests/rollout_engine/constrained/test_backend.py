"""The xgrammar backend: compile off the caller's thread, an LRU cache keyed by (kind, spec),
invalid specs as ValueErrors that name the field and the problem."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from rollout_engine.constrained import (
    NoGrammarBackend,
    XGrammarBackend,
    check_grammar,
    constraint_from_params,
    create_grammar_backend,
    make_constraint,
    refuse_structured_output,
)
from rollout_engine.constrained.backend import xgrammar_json_schema

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _accepts(backend: XGrammarBackend, tokenizer: Any, kind: str, spec: Any, text: str) -> bool:
    """Whether the grammar takes ``text`` (any tokenization: the grammar is over bytes) and
    then a stop token."""
    state = backend.compile(make_constraint(kind, spec)).result().new_state()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(state.accept(t) for t in ids) and state.accept(tokenizer.eos_token_id) \
        and state.is_terminated()


def test_compile_is_cached_and_shared(tokenizer: Any) -> None:
    be = XGrammarBackend(tokenizer, 512)
    try:
        c = make_constraint("json_schema", json.dumps(SCHEMA))
        start = time.perf_counter()
        first = be.compile(c)
        grammar = first.result()
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        again = be.compile(make_constraint("json_schema", SCHEMA))   # same key from an object
        cached_s = time.perf_counter() - start
        assert again is first and again.result() is grammar
        assert grammar.compile_s > 0 and cached_s < first_s
        stats = be.stats()
        assert (stats["compiles"], stats["cache_hits"], stats["cached"]) == (1, 1, 1)
        print(f"compile: first {first_s * 1e3:.2f} ms, cached {cached_s * 1e6:.1f} us")
    finally:
        be.shutdown()


def test_cache_is_a_bounded_lru(tokenizer: Any) -> None:
    be = XGrammarBackend(tokenizer, 512, cache_size=2)
    try:
        a, b, c = (make_constraint("regex", r) for r in ("a+", "b+", "c+"))
        for x in (a, b, a, c):           # a is used again, so b is the oldest when c arrives
            be.compile(x).result()
        assert be.stats()["cached"] == 2
        be.compile(a).result()
        assert be.stats()["compiles"] == 3
        be.compile(b).result()
        assert be.stats()["compiles"] == 4
    finally:
        be.shutdown()


def test_compile_does_not_block_the_caller(tokenizer: Any) -> None:
    be = XGrammarBackend(tokenizer, 512)
    try:
        specs = [dict(SCHEMA, title=f"s{i}") for i in range(6)]
        start = time.perf_counter()
        futures = [be.compile(make_constraint("json_schema", s)) for s in specs]
        submit_s = time.perf_counter() - start
        grammars = [f.result() for f in futures]
        assert submit_s < sum(g.compile_s for g in grammars) + 0.05
        assert len({id(g) for g in grammars}) == 6
    finally:
        be.shutdown()


BAD = [
    ("json_schema", '{"type": "object",', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_schema", '{"type": "objectx"}', 'Unsupported type "objectx"'),
    ("json_schema", {"type": "string", "pattern": "[a-z]+", "maxLength": 3},
     "combines pattern with maxLength"),
    ("regex", "(ab", "parenthesis is not closed"),
    ("regex", "", "must not be empty"),
    ("regex", 5, "must be a string"),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ("ebnf", 'root ::= "a" |', "EBNF parser error"),
    ("structural_tag", {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]},
     "triggers: must be a non-empty list"),
    ("structural_tag", {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                        "triggers": ["<g"]}, "starts with none of the triggers"),
    ("structural_tag", {"format": "json"}, "format: must be an object"),
    ("structural_tag", {"type": "structural_tag"}, "needs either structures + triggers"),
    ("structural_tag", {"format": {"type": "nonsense"}}, "xgrammar cannot use"),
]


@pytest.mark.parametrize("kind, spec, problem", BAD, ids=[f"{k}-{p[:20]}" for k, _, p in BAD])
def test_invalid_specs_name_the_field_and_the_problem(kind: str, spec: Any, problem: str) -> None:
    field = f"sampling_params.{kind}"
    with pytest.raises(ValueError) as info:
        check_grammar(make_constraint(kind, spec, field))
    message = str(info.value)
    assert message.startswith(field) and problem in message, message
    assert "/project/cpp" not in message    # xgrammar's source location is stripped


def test_compile_errors_surface_on_the_future(backend: XGrammarBackend) -> None:
    c = make_constraint("regex", "(ab", "sampling_params.regex")   # submission check skipped
    with pytest.raises(ValueError, match=r"^sampling_params.regex: xgrammar cannot compile"):
        backend.compile(c).result()


def test_two_constraints_on_one_request_name_both() -> None:
    with pytest.raises(ValueError, match="^sampling_params.json_schema and sampling_params.regex:"):
        constraint_from_params({"json_schema": "{}", "regex": "a", "ebnf": None})
    assert constraint_from_params({"json_schema": None, "temperature": 0.5}) is None
    c = constraint_from_params({"json_schema": "$$ANY$$"})
    assert c is not None and c.kind == "json_object"   # SGLang's "any JSON"


def test_spec_is_canonical_text() -> None:
    a = make_constraint("json_schema", '{"b": 1,\n "a": {"type": "integer"}}')
    b = make_constraint("json_schema", {"b": 1, "a": {"type": "integer"}})
    assert a.key == b.key and a.spec == '{"b":1,"a":{"type":"integer"}}'   # order kept


def test_json_schema_kinds(backend: XGrammarBackend, tokenizer: Any) -> None:
    assert _accepts(backend, tokenizer, "json_schema", SCHEMA, '{"name": "ab", "age": 3}')
    assert not _accepts(backend, tokenizer, "json_schema", SCHEMA, '{"name": "ab"}')
    assert not _accepts(backend, tokenizer, "json_schema", SCHEMA,
                        '{"name": "abcdefghi", "age": 3}')   # maxLength 8
    assert not _accepts(backend, tokenizer, "json_schema", SCHEMA,
                        '{"name": "a\x01", "age": 3}')   # raw control characters are not JSON
    assert _accepts(backend, tokenizer, "json_object", None, '[1, {"x": null}]')
    assert not _accepts(backend, tokenizer, "json_object", None, "{x}")


def test_bounded_strings_become_patterns() -> None:
    out = json.loads(xgrammar_json_schema(json.dumps(SCHEMA)))
    assert "maxLength" not in out["properties"]["name"]
    assert out["properties"]["name"]["pattern"].endswith("{0,8}$")
    plain = json.dumps({"type": "object", "properties": {"maxLength": {"type": "integer"}}})
    assert xgrammar_json_schema(plain) == plain    # a property named maxLength is left alone


LEGACY_TAG = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": "<tool_call>", "end": "</tool_call>",
     "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}]}
FORMAT_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"begin": "<tool_call>", "end": "</tool_call>",
         "content": {"type": "json_schema", "json_schema": LEGACY_TAG["structures"][0]["schema"]}}]}}


@pytest.mark.parametrize("tag", [LEGACY_TAG, FORMAT_TAG], ids=["legacy", "format"])
def test_structural_tag_both_forms(backend: XGrammarBackend, tokenizer: Any,
                                   tag: dict[str, Any]) -> None:
    check_grammar(make_constraint("structural_tag", json.dumps(tag)))
    assert _accepts(backend, tokenizer, "structural_tag", tag,
                    'free text <tool_call>{"x": 4}</tool_call> more')
    assert not _accepts(backend, tokenizer, "structural_tag", tag,
                        'free text <tool_call>{"x": "four"}</tool_call>')


def test_regex_and_ebnf(backend: XGrammarBackend, tokenizer: Any) -> None:
    assert _accepts(backend, tokenizer, "regex", r"(yes|no)-\d{2}", "no-42")
    assert not _accepts(backend, tokenizer, "regex", r"(yes|no)-\d{2}", "maybe-42")
    ebnf = 'root ::= "(" root ")" | [a-c]'
    assert _accepts(backend, tokenizer, "ebnf", ebnf, "((b))")
    assert not _accepts(backend, tokenizer, "ebnf", ebnf, "((b)")


def test_disabled_backends_refuse_with_a_reason(tokenizer: Any) -> None:
    c = make_constraint("regex", "a+", "sampling_params.regex")
    with pytest.raises(ValueError, match=r"^sampling_params.regex: .*--grammar-backend xgrammar"):
        NoGrammarBackend().validate(c)
    with pytest.raises(ValueError, match=r"^sampling_params.regex: structured output is not "
                                         r"enabled yet"):
        refuse_structured_output(c)
    assert isinstance(create_grammar_backend("none", tokenizer, 512), NoGrammarBackend)
    with pytest.raises(ValueError, match="^grammar_backend: must be one of xgrammar, none"):
        create_grammar_backend("outlines", tokenizer, 512)
