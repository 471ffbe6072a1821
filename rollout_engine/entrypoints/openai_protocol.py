"""Request schemas of the OpenAI-compatible routes, and their mapping to ``sampling_params``.

Types are strict (a string is not a number) and unknown fields are errors, so a typo is a 400
rather than a silently ignored option. Beyond OpenAI's fields, the SGLang / vLLM extensions RL
code uses are accepted: ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``, ``rid``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # extensions (SGLang / vLLM)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    rid: Optional[str] = None

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias: is not supported")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        return {
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim, "n": self.n, "sampling_seed": self.seed,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ValueError("suffix: is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: is not supported (other than best_of == n)")
        if self.echo and self.stream:
            raise ValueError("echo: is not supported with stream")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: must be >= 0, got {self.logprobs}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``tool_calls``, ...) go to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Optional[Union[str, list[TextPart]]] = None

    def template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ResponseFormat(_Strict):
    type: str
    json_schema: Optional[dict[str, Any]] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    # extensions
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise ValueError("tools: tool calling is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs: requires logprobs = true")
            if not 0 <= self.top_logprobs <= 20:
                raise ValueError(f"top_logprobs: must be in [0, 20], got {self.top_logprobs}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt = false")

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
