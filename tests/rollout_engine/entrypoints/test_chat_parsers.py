"""--tool-call-parser and --reasoning-parser on /v1/chat/completions, whole and streamed: the
real engine forced (by a regex) to write a think block and a tool call, and the route over
fixed outputs for the formats a random model cannot be made to write without a grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.openai_api import add_openai_routes
from tests.rollout_engine.constrained.test_openai import _FixedOutput
from tests.rollout_engine.constrained.test_tool_calls import TOOLS
from tests.rollout_engine.engines import app_client, thread_engine

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
FORCED = f"<think>I should call the tool.</think>Sure.\n<tool_call>\n{CALL}\n</tool_call>"


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return re.sub(r"([.^$*+?()\[\]{}|\\/])", r"\\\1", text)


def _events(r: Any) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
            if e and e != "data: [DONE]"]


def _joined(events: list[dict[str, Any]], key: str) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in events if e["choices"])


def _streamed_calls(events: list[dict[str, Any]]) -> list[tuple[int, str, Any]]:
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get(
        "tool_calls") or []]
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls]


# -- the real engine, its output forced by a regex -----------------------------------------------
@pytest.fixture(scope="module")
def client(qwen2_path: str) -> Iterator[TestClient]:
    for engine in thread_engine(qwen2_path, context_length=512, tool_call_parser="qwen25",
                                reasoning_parser="deepseek-r1"):
        yield from app_client(engine)


def _forced(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "tools": TOOLS, "regex": _literal(FORCED), "max_tokens": 120,
            "temperature": 0.0, **fields}


def test_reasoning_and_tool_call_come_apart(client: TestClient) -> None:
    out = client.post("/v1/chat/completions", json=_forced()).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", out
    message = choice["message"]
    assert message["reasoning_content"] == "I should call the tool."
    assert message["content"] == "Sure."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_reasoning_and_tool_call_streamed(client: TestClient) -> None:
    events = _events(client.post("/v1/chat/completions", json=_forced(stream=True)))
    assert _joined(events, "reasoning_content") == "I should call the tool."
    assert _joined(events, "content").strip() == "Sure."
    assert _streamed_calls(events) == [(0, "get_weather", {"city": "Paris", "unit": "c"})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_separate_reasoning_false_leaves_the_block_in_content(client: TestClient) -> None:
    message = client.post("/v1/chat/completions",
                          json=_forced(separate_reasoning=False)).json()["choices"][0]["message"]
    assert message["content"] == "<think>I should call the tool.</think>Sure."
    assert "reasoning_content" not in message and len(message["tool_calls"]) == 1


def test_without_tools_only_the_reasoning_is_split(client: TestClient) -> None:
    body = {**_forced(), "tools": None}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I should call the tool."
    assert message["content"] == f"Sure.\n<tool_call>\n{CALL}\n</tool_call>"


# -- the route over fixed outputs ---------------------------------------------------------------
class _Recording(_FixedOutput):
    """_FixedOutput on a server with these flags, keeping what each request submitted."""

    def __init__(self, tokenizer: Any, text: str, **flags: Any) -> None:
        super().__init__(tokenizer, text)
        self.engine.config.__dict__.update(flags)
        self.submitted: list[dict[str, Any]] = []

    async def submit(self, **kwargs: Any) -> tuple[list[Any], bool]:
        self.submitted.append(kwargs)
        return await super().submit(**kwargs)


@pytest.fixture(scope="module")
def tokenizer(qwen2_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen2_path)


def _route(tokenizer: Any, text: str, **flags: Any) -> tuple[TestClient, _Recording]:
    service = _Recording(tokenizer, text, **flags)
    app = FastAPI()
    add_openai_routes(app, service, "m")   # type: ignore[arg-type]
    return TestClient(app), service


LLAMA_CALL = '{"name": "time_in", "parameters": {"zone": 2}}'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_llama3_calls_and_r1_reasoning_without_an_opening_tag(tokenizer: Any,
                                                              stream: bool) -> None:
    """DeepSeek-R1's output starts inside the block (its prompt opens it); a Llama 3 call
    follows <|python_tag|>, which is a special token: kept in the text for the parser."""
    text = "Think about zones.</think>On it.<|python_tag|>" + LLAMA_CALL
    client, service = _route(tokenizer, text, tool_call_parser="llama3",
                             reasoning_parser="deepseek-r1")
    body = {"messages": MESSAGES, "tools": TOOLS, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert service.submitted[0]["sampling_params"]["skip_special_tokens"] is False
    if stream:
        events = _events(r)
        got = (_joined(events, "reasoning_content"), _joined(events, "content"),
               _streamed_calls(events), events[-1]["choices"][0]["finish_reason"])
    else:
        choice = r.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        got = (choice["message"]["reasoning_content"], choice["message"]["content"],
               [(i, c["function"]["name"], json.loads(c["function"]["arguments"]))
                for i, c in enumerate(calls)], choice["finish_reason"])
    assert got == ("Think about zones.", "On it.", [(0, "time_in", {"zone": 2})], "tool_calls")


def test_qwen3_thinking_follows_enable_thinking(tokenizer: Any) -> None:
    text = "Plain answer, no block."
    client, _ = _route(tokenizer, text, reasoning_parser="qwen3")
    on = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert on["choices"][0]["message"]["reasoning_content"] == text    # cut-short thinking
    assert on["choices"][0]["message"]["content"] == ""
    off = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["choices"][0]["message"] == {"role": "assistant", "content": text,
                                            "reasoning_content": None}
    none = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "reasoning_effort": "none"}).json()
    assert none["choices"][0]["message"]["content"] == text


def test_stream_reasoning_false_sends_the_block_whole(tokenizer: Any) -> None:
    client, _ = _route(tokenizer, "one two three four five</think>done",
                       reasoning_parser="deepseek-r1")
    events = _events(client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "stream_reasoning": False}))
    pieces = [e["choices"][0]["delta"]["reasoning_content"] for e in events
              if e["choices"][0]["delta"].get("reasoning_content")]
    assert pieces == ["one two three four five"] and _joined(events, "content") == "done"


def test_no_parser_flags_keep_todays_output(tokenizer: Any) -> None:
    text = f"<think>x</think><tool_call>\n{CALL}\n</tool_call>"
    client, service = _route(tokenizer, text)
    plain = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}
    tools = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    message = tools.json()["choices"][0]["message"]
    assert message["content"] == "<think>x</think>" and len(message["tool_calls"]) == 1
    assert service.submitted[1]["sampling_params"]["skip_special_tokens"] is None


def test_a_forced_tool_choice_is_not_read_as_reasoning(tokenizer: Any) -> None:
    """Under a grammar the output starts outside the think block: a forced call is a call
    even with a reasoning parser whose outputs otherwise start inside it."""
    client, _ = _route(tokenizer, f"<tool_call>\n{CALL}\n</tool_call>",
                       reasoning_parser="deepseek-r1")
    choice = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_the_openai_client_reads_reasoning_content(tokenizer: Any) -> None:
    import openai

    client, _ = _route(tokenizer, "Hmm, zones.</think>It is noon.",
                       reasoning_parser="deepseek-r1")
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                       http_client=client)
    r = oc.chat.completions.create(model="m", messages=MESSAGES)   # type: ignore[arg-type]
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (   # type: ignore[attr-defined]
        "Hmm, zones.", "It is noon.")
    reasoning, content = "", ""
    for chunk in oc.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore
                                            stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("Hmm, zones.", "It is noon.")
