"""The request surface of structured output: SGLang's sampling_params and the OpenAI fields
(response_format, extra_body regex / ebnf, tools + tool_choice) become one checked constraint:
a well-formed one runs, a bad one is a 400 that names the field, before any compute. Tool calls
in the output become OpenAI tool_calls (whole and streamed)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.openai_api import add_openai_routes
from rollout_engine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    constraint_params,
)
from rollout_engine.request_builder import RequestLimits
from rollout_engine.sampling_params import SamplingParams
from tests.rollout_engine.constrained.test_tool_calls import OUTPUT, TOOLS
from tests.rollout_engine.engines import app_client, thread_engine

MESSAGES = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}
GREEDY = {"max_new_tokens": 2, "temperature": 0.0}


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"messages": MESSAGES, **fields})


# -- translation -------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, kind, name", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}}, "json_schema",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     "json_object", "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}},
     "structural_tag", "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}}}, "structural_tag", "response_format"),
    ({"regex": "(a|b)+"}, "regex", "regex"),
    ({"ebnf": 'root ::= "a"'}, "ebnf", "ebnf"),
    ({"tools": TOOLS}, None, None),
    ({"tools": TOOLS, "tool_choice": "auto"}, None, None),
    ({"tools": TOOLS, "tool_choice": "required"}, "structural_tag", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "time_in"}}},
     "structural_tag", "tool_choice"),
], ids=["text", "json_object", "json_schema", "json_schema-no-schema", "tag-legacy",
        "tag-format", "regex", "ebnf", "tools", "auto", "required", "named"])
def test_chat_fields_become_one_constraint(fields: dict[str, Any], kind: Any, name: Any) -> None:
    c = _chat(**fields).constraint()
    assert (c and c.kind, c and c.name) == (kind, name)
    sp = SamplingParams.from_dict(_chat(**fields).sampling_params(8))   # SGLang's names
    assert (sp.constraint and sp.constraint.kind) == kind
    if c is not None:
        assert sp.constraint is not None and sp.constraint.spec == c.spec


def test_json_object_is_sglangs_any_json() -> None:
    c = _chat(response_format={"type": "json_object"}).constraint()
    assert constraint_params(c) == {"json_schema": "$$ANY$$"}


def test_completion_json_schema_and_response_format() -> None:
    req = CompletionRequest.parse({"prompt": "x", "json_schema": json.dumps(SCHEMA)})
    c = req.constraint()
    assert c is not None and (c.kind, c.name) == ("json_schema", "json_schema")
    req = CompletionRequest.parse({"prompt": "x", "json_schema": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="^regex and json_schema: a request takes one"):
        req.constraint()


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "json_object"}, "regex": "a"},
     "^response_format and regex: a request takes one constraint"),
    ({"ebnf": 'root ::= "a"', "tools": TOOLS, "tool_choice": "required"},
     "^ebnf and tool_choice: a request takes one constraint"),
    ({"response_format": {"type": "xml"}}, "^response_format.type: must be text, json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": "{}"}},
     "^response_format.json_schema: must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{"}}},
     "^response_format.json_schema.schema: not valid JSON"),
    ({"response_format": {"type": "structural_tag"}}, "^response_format: needs either"),
    ({"tool_choice": "required"}, "^tool_choice: \"required\" needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "^tool_choice: function 'x' is not one of the tools"),
])
def test_bad_chat_constraints_name_the_fields(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _chat(**fields).constraint()


def test_tools_are_typed() -> None:
    with pytest.raises(ValueError):
        _chat(tools=[{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ValueError):
        _chat(tools=TOOLS, tool_choice="sometimes")
    assert _chat(tools=TOOLS, tool_choice="none").active_tools == []


# -- accepted when well-formed, refused at the boundary otherwise ----------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir: str) -> Iterator[Any]:
    # compact JSON: a random model given any whitespace may emit it forever
    yield from thread_engine(tiny_dir, context_length=512,
                             constrained_json_disable_any_whitespace=True)


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    yield from app_client(engine)


def _prompt_tokens(engine: Any) -> int:
    return engine.get_server_info()["stats"]["prompt_tokens"]


ST = json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                 "triggers": ["<f>"]})


@pytest.mark.parametrize("params", [
    {"json_schema": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}, {"regex": "(yes|no)"},
    {"ebnf": 'root ::= "a"'}, {"structural_tag": ST}])
def test_generate_takes_well_formed_constraints(client: TestClient, params: dict[str, Any]
                                                ) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {**GREEDY, **params}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("params, message", [
    ({"json_schema": '{"type": '}, "sampling_params.json_schema: not valid JSON"),
    ({"json_schema": "{}", "regex": "a"},
     "sampling_params.json_schema and sampling_params.regex: a request takes one constraint"),
    ({"regex": ["a"]}, "sampling_params.regex: must be a string"),
    ({"regex": "[a"}, "sampling_params.regex: xgrammar cannot use this regex"),
    ({"ebnf": "root ::= undefined_rule"}, "sampling_params.ebnf: xgrammar cannot use this ebnf"),
    ({"json_schema": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}},
     "sampling_params.json_schema: xgrammar cannot use this json_schema"),
])
def test_generate_refuses_before_any_compute(client: TestClient, engine: Any,
                                             params: dict[str, Any], message: str) -> None:
    before = _prompt_tokens(engine)
    r = client.post("/generate", json={"text": "hi", "sampling_params": {**GREEDY, **params}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        engine.generate(prompt="hi", sampling_params={**GREEDY, **params})
    # a batch with one bad prompt is refused whole
    r = client.post("/generate", json={"text": ["a", "b"],
                                       "sampling_params": [GREEDY, {**GREEDY, **params}]})
    assert r.status_code == 400
    assert _prompt_tokens(engine) == before, "a refused request ran"


@pytest.mark.parametrize("route, fields", [
    ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}}),
    ("chat", {"regex": "a+"}),
    ("chat", {"tools": TOOLS, "tool_choice": "required"}),
    ("completion", {"json_schema": SCHEMA}),
    ("completion", {"response_format": {"type": "json_object"}}),
    ("completion", {"ebnf": 'root ::= "a"'}),
])
def test_openai_takes_well_formed_constraints(client: TestClient, route: str,
                                              fields: dict[str, Any]) -> None:
    if route == "chat":
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                      **fields})
    else:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route, fields, message", [
    ("chat", {"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'},
     "response_format and ebnf: a request takes one constraint"),
    ("chat", {"regex": "(a"}, "regex: xgrammar cannot use this regex"),
    ("completion", {"ebnf": "root ::= "}, "ebnf: xgrammar cannot use this ebnf"),
])
def test_openai_refuses_before_any_compute(client: TestClient, engine: Any, route: str,
                                           fields: dict[str, Any], message: str) -> None:
    before = _prompt_tokens(engine)
    if route == "chat":
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                      **fields})
    else:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)
    assert _prompt_tokens(engine) == before


def test_tools_with_auto_run_now(client: TestClient) -> None:
    """No grammar needed: tools reach the template, the output is parsed (the random model
    writes no call, so the content is the plain run's)."""
    base = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}
    plain = client.post("/v1/chat/completions", json=base).json()["choices"][0]
    for choice in ("auto", "none"):
        r = client.post("/v1/chat/completions", json={**base, "tools": TOOLS,
                                                      "tool_choice": choice})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        assert got["message"] == plain["message"] and "tool_calls" not in got["message"]
        assert got["finish_reason"] == plain["finish_reason"]


# -- tool calls through the routes (a service that answers with a fixed text) -------------------
class _FixedOutput:
    """Stands in for GenerationService: every request "generates" ``text``."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.text = text
        builder = SimpleNamespace(check_constraint=lambda c: None,
                                  limits=RequestLimits(20, 64, 256, 1024))
        config = SimpleNamespace(trust_request_chat_template=False, max_template_render_s=5.0,
                                 tool_call_parser=None, reasoning_parser=None,
                                 sampling_defaults="openai", model_path="unused")
        self.engine = SimpleNamespace(tokenizer=tokenizer, config=config,
                                      tm=SimpleNamespace(builder=builder))

    async def offload(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    offload_template = offload

    async def submit(self, **kwargs: Any) -> tuple[list[Any], bool]:
        n = kwargs["sampling_params"]["n"]
        return [object()] * n, n == 1

    def _meta(self, done: bool) -> dict[str, Any]:
        return {"finish_reason": {"type": "stop", "matched": 2} if done else None,
                "prompt_tokens": 3, "completion_tokens": 9, "cached_tokens": 0}

    async def collect(self, states: list[Any], request: Any = None) -> list[dict[str, Any]]:
        return [{"text": self.text, "meta_info": self._meta(True)} for _ in states]

    async def stream(self, states: list[Any]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        pieces = [self.text[k:k + 7] for k in range(0, len(self.text), 7)]
        for k, piece in enumerate(pieces):
            done = k == len(pieces) - 1
            for i in range(len(states)):
                yield i, {"text": piece, "output_ids": [5], "meta_info": self._meta(done)}


@pytest.fixture
def fixed(tokenizer: Any) -> Any:
    def make(text: str) -> TestClient:
        app = FastAPI()
        add_openai_routes(app, _FixedOutput(tokenizer, text), "m")   # type: ignore[arg-type]
        return TestClient(app)
    return make


def test_tool_calls_in_the_message(fixed: Any) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "n": 2}
    out = fixed(OUTPUT).post("/v1/chat/completions", json=body).json()
    for choice in out["choices"]:
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert msg["content"] == "Let me check."
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "time_in"]
        assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"zone": 1}
    one = fixed(OUTPUT).post("/v1/chat/completions",
                             json={**body, "parallel_tool_calls": False}).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    plain = fixed(OUTPUT).post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT}
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_streamed(fixed: Any) -> None:
    r = fixed(OUTPUT).post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "stream": True})
    events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
              if e and e != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"),
                                                                    (1, "time_in")]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_the_openai_client_reads_the_tool_calls(fixed: Any) -> None:
    """The official client parses our shapes: message.tool_calls and streamed deltas."""
    import openai

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                           http_client=fixed(OUTPUT))
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls is not None
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather"),
                                                          ("function", "time_in")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names[tc.index] = names.get(tc.index, "") + (tc.function.name or "")
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert names == {0: "get_weather", 1: "time_in"}
    assert json.loads(args[1]) == {"zone": 1}


# -- the real engine behind the official client ---------------------------------------------------
def _tool_schemas() -> dict[str, Any]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_tool_choice_forces_a_parseable_call(client: TestClient,
                                                           stream: bool) -> None:
    """tool_choice "required" (any tool) and a named function: the random model's output is
    a valid call of the allowed tools every time, whole and streamed."""
    import jsonschema
    import openai

    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                       http_client=client)
    model = client.get("/v1/models").json()["data"][0]["id"]
    schemas = _tool_schemas()
    for choice, allowed in (("required", set(schemas)),
                            ({"type": "function", "function": {"name": "time_in"}},
                             {"time_in"})):
        for seed in range(3):
            kw = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                  "max_tokens": 200, "temperature": 1.0, "seed": seed,
                  "parallel_tool_calls": False}   # one call, then the grammar ends
            if not stream:
                r = oc.chat.completions.create(**kw)   # type: ignore[call-overload]
                assert r.choices[0].finish_reason == "tool_calls", r
                found = [(c.function.name, c.function.arguments)
                         for c in r.choices[0].message.tool_calls or []]
            else:
                names: dict[int, str] = {}
                args: dict[int, str] = {}
                finish = None
                for chunk in oc.chat.completions.create(stream=True, **kw):  # type: ignore
                    if not chunk.choices:
                        continue
                    finish = chunk.choices[0].finish_reason or finish
                    for tc in chunk.choices[0].delta.tool_calls or []:
                        names[tc.index] = names.get(tc.index, "") + (tc.function.name or "")
                        args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
                assert finish == "tool_calls"
                found = [(names[i], args[i]) for i in sorted(names)]
            assert found, "no tool call"
            for name, arguments in found:
                assert name in allowed
                jsonschema.validate(json.loads(arguments), schemas[name])


def test_response_format_streamed_and_whole(client: TestClient) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                      "maximum": 50},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["x", "tag"]}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    base = {"messages": MESSAGES, "max_tokens": 100, "temperature": 1.0, "seed": 5,
            "response_format": rf}
    whole = client.post("/v1/chat/completions", json=base).json()
    text = whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    r = client.post("/v1/chat/completions", json={**base, "stream": True})
    events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
              if e and e != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e.get("choices"))
    assert streamed == text
    # seeded: any JSON allows whitespace without end, and an unseeded random model can emit
    # "\r" until max_tokens (the engine's own seed differs per run)
    comp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100,
                                                "temperature": 1.0, "seed": 5,
                                                "response_format": {"type": "json_object"},
                                                "stream": True})
    pieces = [json.loads(e[len("data: "):]) for e in comp.text.split("\n\n")
              if e and e != "data: [DONE]"]
    finals = [p["choices"][0]["finish_reason"] for p in pieces
              if p.get("choices") and p["choices"][0].get("finish_reason")]
    assert finals == ["stop"], finals
    json.loads("".join(p["choices"][0]["text"] for p in pieces if p.get("choices")))
