"""vLLM's extra fields on ``/v1/completions`` and ``/v1/chat/completions`` (its
``CompletionRequest`` / ``ChatCompletionRequest``), beside SGLang's.

What each does here:

- changes the answer: ``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``),
  ``return_token_ids`` (the choice's ``token_ids`` and the prompt's ``prompt_token_ids``),
  ``prompt_logprobs`` (vLLM's per-position maps), ``include_stop_str_in_output``,
  ``truncate_prompt_tokens`` + ``truncation_side`` (keep the prompt's last / first k tokens;
  -1: the context length), ``add_special_tokens`` (tokenize a text prompt with them; unset
  keeps SGLang's tokenization), ``request_id`` (the engine's request id when ``rid`` is unset);
  ``min_tokens``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
  ``skip_special_tokens``, ``spaces_between_special_tokens``, ``ignore_eos``, ``cache_salt``
  are shared with SGLang (``openai_protocol.py``).
- accepted, no effect here: ``use_beam_search`` false, ``length_penalty`` (beam search only),
  ``stream_interval``, ``vllm_xargs`` (custom extensions' arguments), ``watermarking``
  (no watermark is configured), ``return_token_offsets`` false.
- refused unless unset (a 400 naming the field): ``use_beam_search`` true, ``bad_words``,
  ``allowed_token_ids``, ``logprob_token_ids``, ``thinking_token_budget``,
  ``repetition_detection``, ``ec_transfer_params``, ``prompt_embeds``,
  ``mm_payload``, ``return_mm_kwargs``, ``return_token_offsets`` true,
  ``routed_experts_prompt_start`` other than 0.
- chat only: ``VllmChatFields``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel

from rollout_engine.entrypoints.token_pieces import TokenPieces
from rollout_engine.entrypoints.vllm_output import prompt_logprobs, stop_reason, through_stop
from rollout_engine.entrypoints.vllm_pd import kv_transfer_answer, kv_transfer_bootstrap
from rollout_engine.request_builder import bootstrap_fields

REFUSED = {
    "bad_words": "bad words are not supported by this server",
    "allowed_token_ids": "allowed_token_ids is not supported by this server",
    "logprob_token_ids": "logprob_token_ids is not supported by this server",
    "thinking_token_budget": "thinking budgets are not supported by this server",
    "repetition_detection": "repetition detection is not supported by this server",
    "ec_transfer_params": "disaggregated serving is not supported by this server",
    "prompt_embeds": "prompt embeddings are not supported by this server",
    "mm_payload": "multimodal input is not supported by this server",
    "return_mm_kwargs": "multimodal input is not supported by this server",
}


class TokenIdPieces:
    """Logprob tokens as vLLM's ``return_tokens_as_token_ids`` shows them: ``token_id:<id>``
    (the piece's bytes are those of that string)."""

    def piece(self, token_id: int) -> tuple[str, bytes]:
        text = f"token_id:{token_id}"
        return text, text.encode()


class VllmOpenAIFields(BaseModel):
    """vLLM's request fields the OpenAI routes take (a base of their request models)."""

    VLLM_FIELDS: ClassVar[tuple[str, ...]] = (
        "return_tokens_as_token_ids", "return_token_ids", "prompt_logprobs",
        "include_stop_str_in_output", "truncate_prompt_tokens", "truncation_side",
        "add_special_tokens", "request_id", "use_beam_search", "length_penalty",
        "stream_interval", "vllm_xargs", "watermarking", "return_token_offsets",
        "routed_experts_prompt_start", *REFUSED)

    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    add_special_tokens: Optional[bool] = None
    request_id: Optional[str] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    stream_interval: Optional[int] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    watermarking: Optional[bool] = None
    return_token_offsets: Optional[bool] = None
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[int]] = None
    logprob_token_ids: Optional[list[int]] = None
    thinking_token_budget: Optional[Union[int, dict[str, Any]]] = None
    repetition_detection: Optional[dict[str, Any]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Optional[dict[str, Any]] = None
    prompt_embeds: Optional[Union[str, list[str]]] = None
    mm_payload: Optional[Any] = None
    return_mm_kwargs: Optional[bool] = None
    routed_experts_prompt_start: Optional[int] = None

    def check_vllm(self) -> None:
        """Refuse what this engine lacks (ValueError naming the field)."""
        if self.use_beam_search:
            raise ValueError("use_beam_search: beam search is not supported by this server "
                             "(send false or leave it unset)")
        if self.return_token_offsets:
            raise ValueError("return_token_offsets: token offsets are not returned by this "
                             "server (send false or leave it unset)")
        for name, why in REFUSED.items():
            if getattr(self, name) not in (None, [], {}, False):
                raise ValueError(f"{name}: {why}")
        if self.routed_experts_prompt_start:
            raise ValueError("routed_experts_prompt_start: vLLM's routed-experts record is not "
                             "returned here (SGLang's return_routed_experts with "
                             "routed_experts_start_len is)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs: must be non-negative or -1, got "
                             f"{self.prompt_logprobs}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError("truncate_prompt_tokens: must be -1 or >= 0, got "
                             f"{self.truncate_prompt_tokens}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be at least 1, got {self.stream_interval}")

    @property
    def pieces_as_ids(self) -> bool:
        return bool(self.return_tokens_as_token_ids)

    def prompt_top(self, vocab_size: int) -> int:
        """How many top candidates the prompt positions need (0: none asked)."""
        k = self.prompt_logprobs
        return 0 if k is None else vocab_size if k == -1 else k

    def shape_prompt(self, ids: list[int], context_len: int) -> list[int]:
        """``truncate_prompt_tokens``: the last (``truncation_side`` left, the default) or
        first k tokens of ``ids``; -1 means the context length."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = context_len if k == -1 else k
        if len(ids) <= k:
            return ids
        return ids[:k] if self.truncation_side == "right" else ids[len(ids) - k:]

    def needs_ids(self) -> bool:
        """Whether a text prompt must be tokenized here (truncation, special tokens)."""
        return self.truncate_prompt_tokens is not None or self.add_special_tokens is not None


class VllmChatFields(VllmOpenAIFields):
    """vLLM's chat-only extras: ``include_reasoning`` (false: no ``reasoning_content`` in the
    message or its deltas), ``documents`` (to the chat template, as transformers passes them),
    ``return_prompt_text`` (the rendered prompt as ``prompt_text``; the first chunk of a
    stream); ``media_io_kwargs`` / ``mm_processor_kwargs`` accepted (text-only models: no
    effect); ``echo`` true refused."""

    VLLM_CHAT_FIELDS: ClassVar[tuple[str, ...]] = (
        "include_reasoning", "documents", "return_prompt_text", "media_io_kwargs",
        "mm_processor_kwargs", "echo")

    include_reasoning: Optional[bool] = None
    documents: Optional[list[dict[str, Any]]] = None
    return_prompt_text: Optional[bool] = None
    media_io_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    echo: Optional[bool] = None

    def check_vllm(self) -> None:
        super().check_vllm()
        if self.echo:
            raise ValueError("echo: echoing the last message is not supported by this server "
                             "(send false or leave it unset)")

    def visible(self, part: dict[str, Any]) -> dict[str, Any]:
        """A message or delta less ``reasoning_content`` when ``include_reasoning`` is false."""
        if self.include_reasoning is False and "reasoning_content" in part:
            part = {k: v for k, v in part.items() if k != "reasoning_content"}
        return part


def shape_prompts(req: VllmOpenAIFields, prompt: Any, tokenizer: Any, context_len: int) -> Any:
    """A route's prompt (text, ids, or a batch of either) as token ids after
    ``add_special_tokens`` and ``truncate_prompt_tokens``."""
    def shape(p: Any) -> list[int]:
        ids = (tokenizer.encode(p, add_special_tokens=bool(req.add_special_tokens))
               if isinstance(p, str) else list(p))
        return req.shape_prompt(ids, context_len)

    if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], (str, list))):
        return shape(prompt)
    return [shape(p) for p in prompt]


def vllm_choice_fields(req: Any, input_ids: Callable[[], Sequence[int]], res: dict[str, Any],
                       whole: bool,
                       token_string: Callable[[int], str]) -> dict[str, Any]:
    """vLLM's extra fields of a choice (or a stream chunk's choice, ``whole`` False):
    ``stop_reason``; with ``return_token_ids`` its ``token_ids`` and, on a whole completion
    choice, ``prompt_token_ids`` (``input_ids()``); a whole choice's ``prompt_logprobs`` when
    asked."""
    meta = res["meta_info"]
    fields: dict[str, Any] = {
        "stop_reason": stop_reason(meta["finish_reason"], req.stop_token_ids or [])}
    if req.return_token_ids:
        fields["token_ids"] = list(res["output_ids"])
        if whole:
            fields["prompt_token_ids"] = list(input_ids())
    if whole and req.prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs(meta, req.prompt_logprobs, token_string)
    return fields


def output_text(req: Any, res: dict[str, Any]) -> str:
    """A whole choice's text; with ``include_stop_str_in_output``, through its stop string."""
    if req.include_stop_str_in_output:
        return through_stop(res["text"], res["meta_info"]["finish_reason"])
    return str(res["text"])


class VllmFieldsServing:
    """The OpenAI routes' handling of vLLM's fields (a base of ``OpenAIServing``, which sets
    ``service`` and ``pieces``)."""

    service: Any
    pieces: TokenPieces

    def pieces_for(self, req: VllmOpenAIFields) -> Any:
        """How logprob entries show a token: decoded, or vLLM's ``token_id:<id>``."""
        return TokenIdPieces() if req.return_tokens_as_token_ids else self.pieces

    async def shaped_prompt(self, req: VllmOpenAIFields, prompt: Any) -> Any:
        """``prompt`` after vLLM's ``add_special_tokens`` / ``truncate_prompt_tokens``."""
        if not req.needs_ids():
            return prompt
        engine = self.service.engine
        return await self.service.offload(shape_prompts, req, prompt, engine.tokenizer,
                                          engine.tm.context_len)

    def vllm_choice(self, req: Any, st: Any, res: dict[str, Any], whole: bool
                    ) -> dict[str, Any]:
        """``vllm_choice_fields`` of request state ``st``'s result ``res``."""
        return vllm_choice_fields(req, lambda: st.req.input_ids, res, whole,
                                  self.token_string)

    def prompt_top(self, req: VllmOpenAIFields) -> int:
        """How many top candidates ``prompt_logprobs`` needs at each prompt position."""
        if req.prompt_logprobs is None:
            return 0
        return req.prompt_top(self.service.engine.tm.builder.vocab_size)

    def bootstrap_for(self, req: Any) -> Optional[dict[str, Any]]:
        """Where a PD pair's decode server fetches this request's KV: SGLang's bootstrap
        fields, or vLLM's ``kv_transfer_params`` (``vllm_pd.py``)."""
        boot = kv_transfer_bootstrap(req.kv_transfer_params, self.service.engine.config)
        return boot if boot is not None else bootstrap_fields(req.__dict__)

    def kv_transfer_answer(self, boot: Optional[dict[str, Any]]) -> dict[str, Any]:
        return kv_transfer_answer(boot, self.service.engine.config)

    def token_string(self, token_id: int) -> str:
        return self.pieces.piece(token_id)[0]
