"""The --reasoning-parser formats: a finished output split into reasoning and content, the same
split from a stream cut at any character, and which requests start inside the think block."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from rollout_engine.parsers import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
    split_reasoning,
)

R1 = REASONING_FORMATS["deepseek-r1"]
QWEN3 = REASONING_FORMATS["qwen3"]
QWEN3_THINKING = REASONING_FORMATS["qwen3-thinking"]
CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'

CASES = [
    # DeepSeek-R1: its prompt opens the block, the output closes it
    (R1, True, "Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    (R1, True, "<think>\nhmm\n</think>\n\n42", "\nhmm\n", "\n\n42"),       # R1-0528 repeats it
    (R1, True, "cut short, still thinking", "cut short, still thinking", ""),
    (R1, True, "a</think>b</think>c", "a", "b</think>c"),                  # one block
    # Qwen3 with thinking on (its default) and off
    (QWEN3, True, "<think>\nplan\n</think>\n\nHello", "\nplan\n", "\n\nHello"),
    (QWEN3, True, "plan" + CALL, "plan", CALL),                    # a call ends the block too
    (QWEN3, False, "Hello, no thinking", None, "Hello, no thinking"),
    (QWEN3, False, "<think>a</think>b", "a", "b"),
    (QWEN3, False, "Hi <think>x</think> there", "x", "Hi  there"),
    (QWEN3, False, "a <thin b", None, "a <thin b"),
    (QWEN3_THINKING, True, "steps</think>done", "steps", "done"),
    (QWEN3_THINKING, True, "", None, ""),
]
IDS = [f"{fmt.name}-{thinking}-{k}" for k, (fmt, thinking, *_) in enumerate(CASES)]


@pytest.mark.parametrize("fmt, thinking, text, reasoning, content", CASES, ids=IDS)
def test_split_finished_output(fmt: ReasoningFormat, thinking: bool, text: str,
                               reasoning: Optional[str], content: str) -> None:
    assert split_reasoning(text, fmt, thinking) == (reasoning, content)


def _pieces(fmt: ReasoningFormat, thinking: bool, chunks: list[str],
            stream_reasoning: bool = True) -> tuple[list[str], list[str]]:
    stream = ReasoningStream(fmt, thinking, stream_reasoning)
    out = [stream.feed(c) for c in chunks] + [stream.finish()]
    return [r for r, _ in out], [c for _, c in out]


@pytest.mark.parametrize("fmt, thinking, text, reasoning, content", CASES, ids=IDS)
def test_streamed_at_every_cut_equals_the_whole(fmt: ReasoningFormat, thinking: bool,
                                                text: str, reasoning: Optional[str],
                                                content: str) -> None:
    """One character at a time, and every split into two pieces: the pieces join to the
    finished split."""
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(len(text) + 1)]
    for chunks in splits:
        rs, cs = _pieces(fmt, thinking, chunks)
        assert ("".join(rs) or None, "".join(cs)) == (reasoning, content), chunks


def test_text_is_held_back_only_while_it_could_be_a_tag() -> None:
    stream = ReasoningStream(QWEN3, False)
    assert stream.feed("Hello <th") == ("", "Hello ")
    assert stream.feed("ese") == ("", "<these")
    stream = ReasoningStream(R1, True)
    assert stream.feed("step 1 </thi") == ("step 1 ", "")
    assert stream.feed("s is not it") == ("</this is not it", "")
    assert stream.feed("</think>ok") == ("", "ok")


def test_stream_reasoning_false_sends_the_block_in_one_piece() -> None:
    text = "a b c</think>done"
    rs, cs = _pieces(R1, True, list(text), stream_reasoning=False)
    assert [r for r in rs if r] == ["a b c"] and "".join(cs) == "done"
    rs, _ = _pieces(R1, True, list("never closed"), stream_reasoning=False)
    assert [r for r in rs if r] == ["never closed"]      # released when the output ends


@pytest.mark.parametrize("fmt, kwargs, prompt, thinking", [
    (R1, {}, "", True),
    (QWEN3, {}, "", True),                                  # Qwen3's template thinks by default
    (QWEN3, {"enable_thinking": True}, "", True),
    (QWEN3, {"enable_thinking": False}, "", False),
    (QWEN3, {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n", True),
    (QWEN3_THINKING, {"enable_thinking": False}, "", True),
])
def test_which_outputs_start_inside_the_block(fmt: ReasoningFormat, kwargs: dict[str, Any],
                                              prompt: str, thinking: bool) -> None:
    assert fmt.thinking(kwargs, prompt) is thinking


def test_sglang_aliases_share_their_format() -> None:
    assert REASONING_FORMATS["step3"] is R1 and REASONING_FORMATS["step3p5"] is R1
    assert REASONING_FORMATS["interns1"] is QWEN3
    assert REASONING_FORMATS["minimax"] is QWEN3_THINKING
