"""Request schemas of the OpenAI-compatible routes, and their mapping to ``sampling_params``.

Every field of SGLang's ``CompletionRequest`` / ``ChatCompletionRequest`` is accepted
(``compat/fields.py`` lists them and how each is treated): the supported ones are typed here;
the others are checked against that list (null or the default value, else a 400 naming the
field) and dropped before validation. Types are strict (a string is not a number) and a name
neither we nor SGLang know is an error, so a typo is a 400 rather than a silently ignored
option. Beyond SGLang's fields: ``spaces_between_special_tokens``, ``add_generation_prompt``
and vLLM's extra fields (``openai_vllm_fields.py``).

Structured output: ``constraint()`` turns ``response_format``, the top-level ``regex`` / ``ebnf``
(``extra_body``), vLLM's ``structured_outputs`` (``vllm_structured_outputs.py``), completions'
``json_schema`` and chat's forcing ``tool_choice`` (a grammar in
the server's tool-call format) into one ``Constraint`` (a ValueError naming both fields when two
are given); ``sampling_params`` carries it under SGLang's names (``json_object`` as
``json_schema="$$ANY$$"``, as SGLang sends it), and fills the sampling fields the request omits
from ``defaults`` (the model's, under ``--sampling-defaults model``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rollout_engine.compat.fields import CHAT_REQUEST, COMPLETION_REQUEST, FieldList
from rollout_engine.constrained.spec import ANY_JSON, Constraint, make_constraint
from rollout_engine.entrypoints.openai_vllm_fields import VllmChatFields, VllmOpenAIFields
from rollout_engine.entrypoints.vllm_structured_outputs import structured_outputs_constraint
from rollout_engine.parsers import DEFAULT_TOOL_FORMAT, tool_call_constraint

M = TypeVar("M", bound="_SamplingFields")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict, VllmOpenAIFields):
    FIELDS: ClassVar[FieldList]   # SGLang's fields of this request type
    ROUTE: ClassVar[str]

    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    sampling_seed: Optional[int] = None   # the sglang-router's name for seed
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
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
    rid: Optional[Union[str, list[str]]] = None
    extra_key: Optional[Union[str, list[str]]] = None
    cache_salt: Optional[Union[str, list[str]]] = None
    # LoRA: an adapter's name as the model (or base:adapter), or lora_path (which wins)
    model: Optional[str] = None
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    # rollout routing replay (the response's sglext.routed_experts, as SGLang)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # prefill-decode disaggregation: set by a PD router on both servers of a pair
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[int]]] = None
    bootstrap_room: Optional[Union[int, str, list[Union[int, str]]]] = None
    # structured output (see constraint())
    response_format: Optional[dict[str, Any]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    _structured_outputs: Any = PrivateAttr(default=None)   # vLLM's, taken out in parse()

    @classmethod
    def parse(cls: type[M], body: Any) -> M:
        """Validate a request body: SGLang's fields we do not type here are checked against
        ``FIELDS`` (null or the default, else ValueError naming the field) and dropped; null
        means the default for every field. vLLM's ``structured_outputs`` is kept aside for
        ``constraint()``."""
        structured = None
        if isinstance(body, dict):
            cls.FIELDS.check(body, cls.ROUTE, unknown_ok=True)
            structured = body.get("structured_outputs")
            body = {k: v for k, v in body.items() if v is not None and k != "structured_outputs"
                    and (k in cls.model_fields or k not in cls.FIELDS)}
        req = cls.model_validate(body)
        req._structured_outputs = structured
        return req

    def check_unsupported(self) -> None:
        self.check_vllm()
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise ValueError(f"sampling_seed: {self.sampling_seed} differs from seed "
                             f"{self.seed}; give one of them")

    def _constraints(self) -> list[Constraint]:
        """Every constraint the request names (constraint() allows one)."""
        found = [response_format_constraint(self.response_format),
                 structured_outputs_constraint(self._structured_outputs)]
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                found.append(make_constraint(name, value, name))
        return [c for c in found if c is not None]

    def constraint(self) -> Optional[Constraint]:
        """The one grammar this request asks for (None: unconstrained); ValueError naming the
        fields when there are two, or naming the one that is malformed."""
        found = self._constraints()
        if len(found) > 1:
            raise ValueError(f"{' and '.join(c.name for c in found)}: a request takes one "
                             "constraint (response_format, regex, ebnf, json_schema or a forced "
                             "tool call); give only one")
        return found[0] if found else None

    def sampling_params(self, max_new_tokens: Optional[int],
                        defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """SGLang's ``sampling_params``; a field the request omits (null) takes its value
        from ``defaults`` when that has one (an explicit value wins, even the default's)."""
        seed = self.seed if self.seed is not None else self.sampling_seed
        params = {**constraint_params(self.constraint()),
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "top_k": -1 if self.top_k == 0 else self.top_k,   # vLLM's 0: no top-k
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": True if self.include_stop_str_in_output else self.no_stop_trim,
            "n": self.n, "sampling_seed": seed,
        }
        for key, value in (defaults or {}).items():
            if params.get(key) is None:
                params[key] = value
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    FIELDS = COMPLETION_REQUEST
    ROUTE = "v1/completions"

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None

    def _constraints(self) -> list[Constraint]:
        found = super()._constraints()
        if self.json_schema is not None:
            found.append(make_constraint("json_schema", self.json_schema, "json_schema"))
        return found

    def check_unsupported(self) -> None:
        super().check_unsupported()
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


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    """An OpenAI tool (functions only, as OpenAI and SGLang)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]

ReasoningEffort = Union[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"],
                        float]


class ChatCompletionRequest(_SamplingFields, VllmChatFields):
    """``POST /v1/chat/completions``."""

    FIELDS = CHAT_REQUEST
    ROUTE = "v1/chat/completions"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # extensions
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[ReasoningEffort] = None
    input_ids: Optional[list[int]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True
    return_meta_info: bool = False
    return_prompt_token_ids: bool = False
    # with --reasoning-parser: split the think block out (False: leave it in content), and
    # stream it as it comes (False: in one piece when it ends)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    _tool_format: str = PrivateAttr(default=DEFAULT_TOOL_FORMAT)

    @classmethod
    def parse(cls, body: Any, tool_format: str = DEFAULT_TOOL_FORMAT
              ) -> ChatCompletionRequest:   # type: ignore[override]
        """``_SamplingFields.parse``; ``tool_format``: the server's tool-call format (the
        shape a forcing ``tool_choice``'s grammar takes)."""
        req = super().parse(body)
        req._tool_format = tool_format
        return req

    @property
    def active_tools(self) -> list[Tool]:
        """The tools the chat template renders and the output is parsed for (none when
        tool_choice is "none", as SGLang)."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def _constraints(self) -> list[Constraint]:
        found = super()._constraints()
        if self.tool_choice not in (None, "auto", "none"):
            c = tool_call_constraint(self.tools or [], self.tool_choice,
                                     self.parallel_tool_calls, fmt=self._tool_format)
            if c is not None:
                found.append(c)
        return found

    def check_unsupported(self) -> None:
        super().check_unsupported()
        effort = self.reasoning_effort
        if isinstance(effort, float) and not 0.0 <= effort <= 0.99:
            raise ValueError(f"reasoning_effort: a number must be in [0, 0.99], got {effort}")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs: requires logprobs = true")
            if self.top_logprobs < 0:   # the upper bound is the server's (RequestLimits)
                raise ValueError(f"top_logprobs: must be >= 0, got {self.top_logprobs}")
        for name in ("return_meta_info", "return_prompt_token_ids"):
            if self.stream and getattr(self, name):
                raise ValueError(f"{name}: not supported with stream = true (as SGLang)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt = false")

    def request_template(self) -> Optional[tuple[str, str]]:
        """The chat template this request sends, as ``(field, template)``: the top-level
        ``chat_template`` or ``chat_template_kwargs.chat_template`` (None: the server's own)."""
        found = [(name, value) for name, value in (
            ("chat_template", self.chat_template),
            ("chat_template_kwargs.chat_template",
             (self.chat_template_kwargs or {}).get("chat_template"))) if value is not None]
        for name, value in found:
            if not isinstance(value, str):
                raise ValueError(f"{name}: must be a string (a Jinja template)")
        if len(found) > 1:
            raise ValueError("chat_template: also given as chat_template_kwargs.chat_template; "
                             "give one")
        return found[0] if found else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs`` less the template itself (``request_template``);
        ``reasoning_effort`` sets ``thinking`` and ``enable_thinking`` (false for "none")
        unless given, as SGLang does."""
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs.pop("chat_template", None)
        if self.reasoning_effort is not None:
            thinking = self.reasoning_effort != "none"
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("enable_thinking", thinking)
        return kwargs

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def response_format_constraint(rf: Optional[dict[str, Any]]) -> Optional[Constraint]:
    """OpenAI's ``response_format``: ``text`` (none), ``json_object`` (any JSON),
    ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``), or ``structural_tag``
    (SGLang's legacy ``structures`` / ``triggers`` or xgrammar's ``format``)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return make_constraint("json_object", None, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: must be an object with name and "
                             "schema")
        if not isinstance(spec.get("name", ""), str):
            raise ValueError("response_format.json_schema.name: must be a string")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            return make_constraint("json_object", None, "response_format.json_schema")
        return make_constraint("json_schema", schema, "response_format.json_schema.schema")
    if kind == "structural_tag":
        return make_constraint("structural_tag", rf, "response_format")
    raise ValueError("response_format.type: must be text, json_object, json_schema or "
                     f"structural_tag, got {json.dumps(kind)}")


def constraint_params(c: Optional[Constraint]) -> dict[str, Any]:
    """The sampling_params fields that carry ``c`` (SGLang's names)."""
    if c is None:
        return {}
    if c.kind == "json_object":
        return {"json_schema": ANY_JSON}
    return {c.kind: c.spec}
