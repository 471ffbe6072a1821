"""vLLM's request shapes for ``/inference/v1/generate`` and their mapping onto the engine.

vLLM (0.32) is the spec: ``GenerateRequest`` and its ``SamplingParams`` take vLLM's field names
and defaults, and unknown keys are ignored at both levels (vLLM's models do not forbid extras).
A value vLLM would refuse is a ``ValueError`` naming the field under its vLLM path
(``sampling_params.top_p: ...``); so is a non-default value of a vLLM feature this engine does
not have (``kv_transfer_params``, ``logit_bias``, multimodal ``features`` ...). A field that has
no effect on the answer here (``stream_interval``, ``extra_args``, ``watermarking`` without a
configured watermark) is accepted.

``engine_params`` turns a request into the engine's (SGLang-named) ``sampling_params``.
``/tokenize`` and ``/detokenize`` take vLLM's shapes too (extra keys ignored, as vLLM).
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_engine.entrypoints.openai_protocol import ChatMessage, Tool

MAX_PRIORITY = 2**63 - 1
MAX_CACHE_SALT = 128                  # vLLM's bound, and characters it refuses in a salt
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class VllmStreamOptions(BaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class VllmSamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` as a JSON body gives it (its defaults; unknown keys ignored)."""

    model_config = ConfigDict(extra="ignore")

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[dict[str, Any]] = None
    # accepted, no effect on the answer here
    watermarking: Optional[bool] = None
    stream_interval: Optional[int] = None
    flat_logprobs: bool = False
    skip_clone: bool = False
    output_kind: Any = None
    extra_args: Optional[dict[str, Any]] = None
    skip_reading_prefix_cache: Optional[bool] = None
    # vLLM features this engine lacks: refused unless at their defaults
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Optional[int] = None
    logprob_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    thinking_token_budget: Optional[int] = None
    repetition_detection: Optional[dict[str, Any]] = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: Optional[list[int]] = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
                   "logit_bias", "allowed_token_ids", "bad_words", "thinking_token_budget",
                   "repetition_detection", "trace_decode_token_ids")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self) -> None:
        """vLLM's range checks (``SamplingParams._verify_args``) and this engine's refusals;
        ValueError naming ``sampling_params.<field>``."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"sampling_params.{name}: {why}")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be 0 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, "
                              f"got {self.min_tokens}")
        if self.stream_interval is not None and self.stream_interval < 1:
            bad("stream_interval", f"must be at least 1, got {self.stream_interval}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                bad(name, f"must be non-negative or -1, got {value}")
        if any(not s for s in self.stops):
            bad("stop", "cannot contain an empty string")
        if self.stops and not self.detokenize:
            bad("stop", "stop strings need detokenize = true")
        if self.routed_experts_prompt_start < 0:
            bad("routed_experts_prompt_start",
                f"must be between 0 and the prompt length, got {self.routed_experts_prompt_start}")
        for name in self.UNSUPPORTED:
            if getattr(self, name) not in (None, [], {}):
                bad(name, "is not supported by this server (leave it unset)")

    def constraint_params(self) -> dict[str, Any]:
        """``structured_outputs`` as the engine's constraint fields (one grammar)."""
        so = self.structured_outputs
        if not so:
            return {}
        kinds = {"json": "json_schema", "regex": "regex", "grammar": "ebnf",
                 "json_object": "json_schema", "structural_tag": "structural_tag"}
        given = {k: v for k, v in so.items() if v not in (None, False)
                 and k not in ("disable_any_whitespace", "disable_additional_properties",
                               "whitespace_pattern", "disable_fallback")}
        unknown = sorted(set(given) - set(kinds))
        if unknown:
            raise ValueError(f"sampling_params.structured_outputs.{unknown[0]}: is not "
                             "supported by this server (json, regex, grammar, json_object "
                             "or structural_tag)")
        if len(given) != 1:
            raise ValueError("sampling_params.structured_outputs: give exactly one of json, "
                             "regex, grammar, json_object or structural_tag")
        (name, value), = given.items()
        if name == "json_object":
            return {"json_schema": '{"type": "object"}'}
        return {kinds[name]: value}

    def engine_params(self, max_tokens: int) -> dict[str, Any]:
        """The engine's ``sampling_params`` for this request, ``max_tokens`` resolved."""
        return {
            **self.constraint_params(),
            "max_new_tokens": max_tokens, "min_new_tokens": self.min_tokens, "n": self.n,
            "temperature": self.temperature, "top_p": self.top_p,
            "top_k": -1 if self.top_k in (0, -1) else self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "stop": self.stops,
            "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.include_stop_str_in_output, "sampling_seed": self.seed,
        }


class VllmGenerateRequest(BaseModel):
    """``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``; unknown keys ignored)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmSamplingParams
    model: Optional[str] = None
    return_token_ids: Optional[bool] = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: Optional[bool] = False
    stream_options: Optional[VllmStreamOptions] = None
    cache_salt: Optional[str] = None
    priority: int = Field(default=0, ge=-(2**63), le=MAX_PRIORITY)
    # accepted: they change nothing without multimodal input or structured output
    token_offsets: Optional[list[tuple[int, int]]] = None
    reasoning_ended: Optional[bool] = None
    reasoning_parser_kwargs: Optional[dict[str, Any]] = None
    # vLLM features this engine lacks
    features: Optional[dict[str, Any]] = None
    content_parts: Optional[list[dict[str, Any]]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Optional[dict[str, Any]] = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not v or len(v) > MAX_CACHE_SALT
                              or any(c in CACHE_SALT_FORBIDDEN for c in v)):
            raise ValueError(f"must be a non-empty string of at most {MAX_CACHE_SALT} "
                             "characters without '@', '/', '\\' or NUL")
        return v

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    def check(self) -> None:
        """vLLM's checks and this engine's refusals (ValueError naming the field)."""
        self.sampling_params.check()
        for name in ("features", "content_parts"):
            if getattr(self, name):
                raise ValueError(f"{name}: multimodal input is not supported by this server")
        for name in ("kv_transfer_params", "ec_transfer_params"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: disaggregated serving is not supported by this "
                                 "server (leave it unset)")
        if self.priority != 0:
            raise ValueError("priority: priority scheduling is not enabled on this server "
                             f"(got {self.priority}; leave it 0)")
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(f"output_mode: {self.output_mode!r} requires "
                             "sampling_params.detokenize to be true")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class VllmTokenizeRequest(BaseModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's ``TokenizeCompletionRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class VllmTokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with ``messages`` (vLLM's ``TokenizeChatRequest``): the chat
    template's prompt, tokenized."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Optional[dict[str, Any]] = None

    def check(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true together with "
                             "add_generation_prompt (set add_generation_prompt to false)")


class VllmDetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_PRIORITY)]]
