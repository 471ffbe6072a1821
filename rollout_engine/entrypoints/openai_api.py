"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

They translate OpenAI shapes to a ``GenerationService`` call and back; tokenization, sampling
and logprobs are the engine's. Choice ``index`` is ``prompt_index * n + sample_index``.

A constraint (``response_format``, ``regex``, ``ebnf``, a forcing ``tool_choice``) is put to the
engine's request builder first, so its 400 names the OpenAI field; so are the per-request caps
(``logprobs`` / ``top_logprobs``, ``stop``, ``stop_token_ids``). Chat ``tools`` go to the chat
template; calls in the output (in the ``--tool-call-parser`` format; ``<tool_call>`` blocks
without one) come back as ``message.tool_calls`` (streamed as ``delta.tool_calls``) with
``finish_reason`` ``"tool_calls"``; with ``--reasoning-parser`` the think block comes back as
``reasoning_content`` (``chat_output.py``). A chat request's omitted sampling fields come from
the model's ``generation_config.json`` under ``--sampling-defaults model`` (SGLang's default;
as SGLang, only on this route).

Chat messages are rendered by ``ChatTemplateRenderer`` (bounded by ``--max-template-render-s``)
in the service's template threads. A template sent with the request is refused (400) unless
the server runs with ``--trust-request-chat-template``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.config.generation_defaults import read_sampling_defaults
from rollout_engine.entrypoints.chat_output import ChatParsing
from rollout_engine.entrypoints.chat_template import ChatTemplateRenderer
from rollout_engine.entrypoints.http_utils import (
    SSE_DONE,
    json_response,
    read_json,
    sse,
    sse_response,
)
from rollout_engine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from rollout_engine.entrypoints.openai_vllm_fields import VllmFieldsServing, output_text
from rollout_engine.entrypoints.serving import GenerationService
from rollout_engine.entrypoints.token_pieces import (
    TextOffsets,
    TokenPieces,
    floor_logprob,
    legacy_logprobs,
)
from rollout_engine.entrypoints.vllm_output import StopCut, prompt_logprobs
from rollout_engine.parsers import tool_format
from rollout_engine.tokenizer_manager import RequestState, SchedulerDeadError


def _finish_reason(reason: Optional[dict[str, Any]]) -> Optional[str]:
    return None if reason is None else str(reason.get("type"))


def _matched_stop(reason: Optional[dict[str, Any]]) -> Any:
    return None if reason is None else reason.get("matched")


def _usage(metas: list[Optional[dict[str, Any]]], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per sample)."""
    firsts = [m for m in metas[::n] if m is not None]
    done = [m for m in metas if m is not None]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _sglext(meta: Optional[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's ``sglext`` of a response (or of a stream chunk that finishes a choice): the
    routed experts of that request (the first choice's, for a whole response), if it asked."""
    if meta is None or "routed_experts" not in meta:
        return {}
    return {"sglext": {"routed_experts": meta["routed_experts"]}}


def _tool_finish(reason: Optional[str], has_calls: bool) -> Optional[str]:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _trim_tops(tops: Optional[list[Any]], k: int) -> Optional[list[Any]]:
    """Each position's top list cut to ``k`` (the engine was asked for more: prompt_logprobs)."""
    return None if tops is None else [t[:k] if t else t for t in tops]


def _prompt_kwargs(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)) or prompt == []:
        return {"prompt": prompt}
    return {"input_ids": prompt}


class OpenAIServing(VllmFieldsServing):
    """Builds OpenAI responses from engine results."""

    def __init__(self, service: GenerationService, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.pieces = TokenPieces(service.engine.tokenizer)
        config = service.engine.config
        self.trust_request_template = config.trust_request_chat_template
        self.renderer = ChatTemplateRenderer(service.engine.tokenizer,
                                             config.max_template_render_s)
        self.tool_call_parser: Optional[str] = config.tool_call_parser
        self.reasoning_parser: Optional[str] = config.reasoning_parser
        self.sampling_defaults = (read_sampling_defaults(config.model_path)
                                  if config.sampling_defaults == "model" else {})

    def check_request(self, req: Union[CompletionRequest, ChatCompletionRequest],
                      top_logprobs: Optional[int], top_logprobs_field: str) -> None:
        """What the engine would refuse, refused first under the OpenAI names: a constraint,
        the per-request caps (top logprobs, stop strings, stop token ids)."""
        builder = self.service.engine.tm.builder
        c = req.constraint()
        if c is not None:
            builder.check_constraint(c)
        builder.limits.check_top_logprobs(top_logprobs or 0, top_logprobs_field)
        builder.limits.check_stops(req.stop, req.stop_token_ids, prefix="")

    def lora_path(self, req: Union[CompletionRequest, ChatCompletionRequest]) -> Any:
        """The adapter a request asks for: its ``lora_path``, else its ``model`` when that
        names a loaded adapter or is SGLang's ``base:adapter`` (split at the first colon);
        None (the base model) for any other model name. The builder refuses an adapter that
        is not loaded."""
        engine = self.service.engine
        if req.lora_path is not None:
            return req.lora_path
        model = req.model
        if model is None or model == self.model_name or not engine.config.enable_lora:
            return None
        if model in engine.tm.control.lora_adapters:
            return model
        _, colon, adapter = model.partition(":")
        return (adapter.strip() or None) if colon else None

    def _header(self, prefix: str, obj: str) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": self.model_name}

    # -- logprobs ------------------------------------------------------------------------------
    def chat_logprobs(self, meta: dict[str, Any], pieces: Any = None,
                      num: Optional[int] = None) -> dict[str, Any]:
        pieces = self.pieces if pieces is None else pieces

        def item(lp: float, tid: int) -> dict[str, Any]:
            s, raw = pieces.piece(tid)
            return {"token": s, "logprob": floor_logprob(lp), "bytes": list(raw)}

        tops = meta.get("output_top_logprobs")
        if num is not None:
            tops = _trim_tops(tops, num)
        content = []
        for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs") or []):
            entry = item(lp, tid)
            entry["top_logprobs"] = [item(v, t) for v, t, _ in (tops[k] if tops else [])]
            content.append(entry)
        return {"content": content}

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = CompletionRequest.parse(await read_json(request))
        req.check_unsupported()
        self.check_request(req, req.logprobs, "logprobs")
        want_lp = req.logprobs is not None
        pieces = self.pieces_for(req)
        prompt_top = self.prompt_top(req)
        boot = self.bootstrap_for(req)
        states, _ = await self.service.submit(
            **_prompt_kwargs(await self.shaped_prompt(req, req.prompt)),
            sampling_params=req.sampling_params(req.max_tokens),
            return_logprob=want_lp or req.prompt_logprobs is not None,
            top_logprobs_num=max(req.logprobs or 0, prompt_top),
            logprob_start_len=0 if ((req.echo and want_lp) or req.prompt_logprobs is not None)
            else -1, stream=req.stream,
            rid=req.rid if req.rid is not None else req.request_id, extra_key=req.extra_key,
            cache_salt=req.cache_salt,
            return_routed_experts=req.return_routed_experts,
            routed_experts_start_len=req.routed_experts_start_len, lora_path=self.lora_path(req),
            bootstrap=boot)
        if req.stream:
            return sse_response(self._stream_completions(req, states))
        results = await self.service.collect(states, request)
        choices = []
        for i, (st, res) in enumerate(zip(states, results)):
            meta = res["meta_info"]
            prefix = ""
            if req.echo:
                prefix = (req.prompt if isinstance(req.prompt, str) else
                          req.prompt[i // req.n] if isinstance(req.prompt[0], str) else
                          self.service.engine.tokenizer.decode(st.req.input_ids))
            logprobs = None
            if want_lp:
                entries = meta.get("output_token_logprobs") or []
                tops = meta.get("output_top_logprobs") if req.logprobs else None
                if req.echo:
                    entries = meta.get("input_token_logprobs", []) + entries
                    if tops is not None:
                        tops = meta.get("input_top_logprobs", []) + tops
                tops = _trim_tops(tops, req.logprobs or 0)
                logprobs = legacy_logprobs(pieces, entries, tops)
            choices.append({"index": i, "text": prefix + output_text(req, res),
                            "logprobs": logprobs,
                            "finish_reason": _finish_reason(meta["finish_reason"]),
                            "matched_stop": _matched_stop(meta["finish_reason"]),
                            **self.vllm_choice(req, st, res, True)})
        return json_response({**self._header("cmpl", "text_completion"), "choices": choices,
                              "usage": _usage([r["meta_info"] for r in results], req.n),
                              **_sglext(results[0]["meta_info"]),
                              **self.kv_transfer_answer(boot)})

    async def _stream_completions(self, req: CompletionRequest,
                                  states: list[RequestState]) -> AsyncIterator[bytes]:
        header = self._header("cmpl", "text_completion")
        metas: list[Optional[dict[str, Any]]] = [None] * len(states)
        offsets = [TextOffsets() for _ in states]
        pieces = self.pieces_for(req)
        cuts = [StopCut(bool(req.include_stop_str_in_output)) for _ in states]
        try:
            async with aclosing(self.service.stream(states)) as stream:
                async for i, chunk in stream:
                    meta = chunk["meta_info"]
                    reason = meta["finish_reason"]
                    logprobs = None
                    if req.logprobs is not None and chunk["output_ids"]:
                        logprobs = legacy_logprobs(
                            pieces, meta.get("output_token_logprobs") or [],
                            meta.get("output_top_logprobs") if req.logprobs else None,
                            offsets[i])
                    text = cuts[i].delta(chunk["text"], reason)
                    if reason is not None:
                        metas[i] = meta
                    elif not text and logprobs is None:
                        continue
                    yield sse({**header, "choices": [{
                        "index": i, "text": text, "logprobs": logprobs,
                        "finish_reason": _finish_reason(reason),
                        "matched_stop": _matched_stop(reason),
                        **self.vllm_choice(req, states[i], chunk, False)}], **_sglext(meta)})
            if req.include_usage:
                yield sse({**header, "choices": [], "usage": _usage(metas, req.n)})
        except SchedulerDeadError as e:
            yield sse({"error": {"message": str(e), "code": 503}})
        yield SSE_DONE

    # -- /v1/chat/completions ------------------------------------------------------------------
    def request_template(self, req: ChatCompletionRequest) -> Optional[str]:
        """The template the request sends, if this server takes one (ValueError if not)."""
        found = req.request_template()
        if found is None:
            return None
        if not self.trust_request_template:
            raise ValueError(f"{found[0]}: this server renders chat with its own template and "
                             "does not run templates sent with requests (start it with "
                             "--trust-request-chat-template to allow them)")
        return found[1]

    def render_chat(self, req: ChatCompletionRequest, template: Optional[str]) -> str:
        """The prompt text of ``req``'s messages."""
        return self.renderer.render(
            [m.template_dict() for m in req.messages],
            tools=[t.model_dump(exclude_none=True) for t in req.active_tools],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.template_kwargs, template=template, documents=req.documents)

    async def chat_completions(self, request: Request) -> Response:
        req = ChatCompletionRequest.parse(await read_json(request),
                                          tool_format(self.tool_call_parser))
        req.check_unsupported()
        self.check_request(req, req.top_logprobs, "top_logprobs")
        template = self.request_template(req)
        text = "" if req.input_ids is not None else await self.service.offload_template(
            self.render_chat, req, template)
        prompt: dict[str, Any] = _prompt_kwargs(await self.shaped_prompt(
            req, req.input_ids if req.input_ids is not None else text))
        parsing = ChatParsing.of(req, self.tool_call_parser, self.reasoning_parser, text)
        params = req.sampling_params(req.max_new_tokens, self.sampling_defaults)
        if (parsing.tool_names is not None and self.tool_call_parser is not None
                and params["skip_special_tokens"] is None):
            params["skip_special_tokens"] = False    # a call may open with a special token
        prompt_top = self.prompt_top(req)
        boot = self.bootstrap_for(req)
        states, _ = await self.service.submit(
            **prompt, sampling_params=params,
            return_logprob=req.logprobs or req.prompt_logprobs is not None,
            top_logprobs_num=max(req.top_logprobs or 0, prompt_top),
            logprob_start_len=0 if req.prompt_logprobs is not None else -1,
            stream=req.stream, rid=req.rid if req.rid is not None else req.request_id,
            extra_key=req.extra_key, cache_salt=req.cache_salt,
            return_routed_experts=req.return_routed_experts,
            routed_experts_start_len=req.routed_experts_start_len, lora_path=self.lora_path(req),
            bootstrap=boot)
        if req.stream:
            return sse_response(self._stream_chat(req, states, parsing, text))
        results = await self.service.collect(states, request)
        choices = []
        for i, res in enumerate(results):
            meta = res["meta_info"]
            output = parsing.output()
            message = req.visible(output.message(output_text(req, res)))
            choices.append({
                "index": i, "message": message,
                "logprobs": (self.chat_logprobs(meta, self.pieces_for(req), req.top_logprobs or 0)
                             if req.logprobs else None),
                "finish_reason": _tool_finish(_finish_reason(meta["finish_reason"]),
                                              output.has_calls),
                "matched_stop": _matched_stop(meta["finish_reason"]),
                **self.vllm_choice(req, states[i], res, False)})
            if req.return_meta_info:
                choices[-1]["meta_info"] = meta
            if req.return_prompt_token_ids:
                choices[-1]["prompt_token_ids"] = list(states[i].req.input_ids)
        extras = {}
        if req.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs(results[0]["meta_info"],
                                                        req.prompt_logprobs, self.token_string)
        if req.return_token_ids:
            extras["prompt_token_ids"] = list(states[0].req.input_ids)
        if req.return_prompt_text:
            extras["prompt_text"] = text
        return json_response({**self._header("chatcmpl", "chat.completion"), "choices": choices,
                              "usage": _usage([r["meta_info"] for r in results], req.n),
                              **_sglext(results[0]["meta_info"]), **extras,
                              **self.kv_transfer_answer(boot)})

    async def _stream_chat(self, req: ChatCompletionRequest, states: list[RequestState],
                           parsing: ChatParsing, prompt_text: str) -> AsyncIterator[bytes]:
        header = self._header("chatcmpl", "chat.completion.chunk")
        metas: list[Optional[dict[str, Any]]] = [None] * len(states)
        outputs = [parsing.output() for _ in states]
        cuts = [StopCut(bool(req.include_stop_str_in_output)) for _ in states]
        try:
            for i in range(len(states)):
                first = {"prompt_text": prompt_text} if req.return_prompt_text and i == 0 else {}
                yield sse({**header, "choices": [{
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}], **first})
            async with aclosing(self.service.stream(states)) as stream:
                async for i, chunk in stream:
                    meta = chunk["meta_info"]
                    reason = meta["finish_reason"]
                    logprobs = (self.chat_logprobs(meta, self.pieces_for(req),
                                                   req.top_logprobs or 0)
                                if req.logprobs and chunk["output_ids"] else None)
                    deltas = outputs[i].feed(cuts[i].delta(chunk["text"], reason))
                    if reason is not None:
                        deltas += outputs[i].finish()
                        metas[i] = meta
                    deltas = [d for d in map(req.visible, deltas) if d]
                    if reason is None and not deltas and logprobs is None:
                        continue
                    finish = _tool_finish(_finish_reason(reason), outputs[i].has_calls)
                    for delta in deltas[:-1]:
                        yield sse({**header, "choices": [{
                            "index": i, "delta": delta, "logprobs": None,
                            "finish_reason": None}]})
                    yield sse({**header, "choices": [{
                        "index": i, "delta": deltas[-1] if deltas else {}, "logprobs": logprobs,
                        "finish_reason": finish, "matched_stop": _matched_stop(reason),
                        **self.vllm_choice(req, states[i], chunk, False)}], **_sglext(meta)})
            if req.include_usage:
                yield sse({**header, "choices": [], "usage": _usage(metas, req.n)})
        except SchedulerDeadError as e:
            yield sse({"error": {"message": str(e), "code": 503}})
        yield SSE_DONE

    # -- /v1/models ----------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """The served model, then each loaded LoRA adapter (SGLang's cards: ``root`` its
        path, ``parent`` the served model)."""
        engine = self.service.engine
        now = int(time.time())
        cards = [{"id": self.model_name, "object": "model", "created": now,
                  "owned_by": "rollout_engine", "root": engine.config.model_path,
                  "max_model_len": engine.tm.context_len}]
        for name, ref in sorted(engine.tm.control.lora_adapters.items()):
            cards.append({"id": name, "object": "model", "created": now,
                          "owned_by": "rollout_engine", "root": ref.get("lora_path"),
                          "parent": self.model_name, "max_model_len": None})
        return {"object": "list", "data": cards}


def add_openai_routes(app: FastAPI, service: GenerationService, model_name: str) -> None:
    serving = OpenAIServing(service, model_name)
    app.post("/v1/completions")(serving.completions)
    app.post("/v1/chat/completions")(serving.chat_completions)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())
