"""vLLM's data routes on the same engine: ``/inference/v1/generate`` (token in, token out),
``/tokenize`` and ``/detokenize``, in vLLM's request and response shapes.

``/inference/v1/generate`` takes vLLM's ``GenerateRequest`` (``vllm_protocol.py``) and answers
its ``GenerateResponse``: one choice per sample (``sampling_params.n``), each with the output
``token_ids``, ``finish_reason``, ``stop_reason``, ``logprobs`` (``logprobs`` set: the sampled
token and its top candidates) and ``weight_versions`` (the weight-version spans its tokens were
sampled under); ``prompt_logprobs`` when asked; ``usage`` counting the prompt once. With
``stream`` it answers SSE chunks of token deltas (the spans on each choice's final chunk), a
usage chunk when ``stream_options.include_usage``, then ``[DONE]``. ``model`` may name a loaded
LoRA adapter (the request runs on it); any other name but the served model's is a 404, as vLLM.
``cache_salt`` gives the request its own prefix-cache namespace. Errors are vLLM's JSON body.

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` default true) or chat ``messages``
(rendered by the server's chat template; ``add_special_tokens`` default false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}`` (special tokens kept). ``/inference/v1/abort_requests`` aborts
generate requests by their ``request_id``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Optional

import pydantic
from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints import vllm_output as out
from rollout_engine.entrypoints.chat_template import ChatTemplateRenderer
from rollout_engine.entrypoints.http_utils import (
    SSE_DONE,
    HTTPError,
    json_response,
    read_json,
    sse,
    sse_response,
)
from rollout_engine.entrypoints.token_pieces import TokenPieces
from rollout_engine.entrypoints.vllm_protocol import (
    VllmDetokenizeRequest,
    VllmGenerateRequest,
    VllmTokenizeChatRequest,
    VllmTokenizeRequest,
)
from rollout_engine.tokenizer_manager import RequestState, SchedulerDeadError

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine
    from rollout_engine.entrypoints.serving import GenerationService

PREFIX = "generate-tokens-"   # vLLM's request ids on this route: the prefix + the caller's id


def validation_param(err: dict[str, Any]) -> str:
    """The dotted field path of a pydantic error (``sampling_params.max_tokens``)."""
    return ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))


def parse_or_error(model: type[pydantic.BaseModel], body: Any
                   ) -> tuple[Optional[Any], Optional[Response]]:
    """``model`` validated from ``body``, or vLLM's 400 naming the first bad field."""
    try:
        return model.model_validate(body), None
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        param = validation_param(dict(err))
        return None, out.vllm_error(400, f"{param}: {err.get('msg', 'invalid')}", param)


class VllmGenerate:
    """The token-in, token-out route over a ``GenerationService``."""

    def __init__(self, engine: Engine, service: GenerationService) -> None:
        self.engine = engine
        self.service = service
        self.model_name = engine.config.served_model_name or engine.config.model_path
        self.pieces = TokenPieces(engine.tokenizer)
        self.routing_shape = _routing_shape(engine)

    def piece(self, token_id: int) -> str:
        return self.pieces.piece(token_id)[0]

    def adapter(self, model: Optional[str]) -> tuple[Optional[str], Optional[Response]]:
        """The LoRA adapter ``model`` names (None: the base model), or vLLM's 404."""
        if model is None or model in (self.model_name, self.engine.config.model_path):
            return None, None
        if self.engine.config.enable_lora and model in self.engine.tm.control.lora_adapters:
            return model, None
        return None, out.vllm_error(
            404, f"The model `{model}` does not exist. Valid aliases: {self.model_name}.",
            "model")

    def max_tokens(self, req: VllmGenerateRequest) -> int:
        """The request's ``max_tokens``; unset (or null), what the context leaves (vLLM's
        server-side default), bounded by the KV pool."""
        sp = req.sampling_params
        if sp.max_tokens is not None and "max_tokens" in sp.model_fields_set:
            return sp.max_tokens
        room = self.engine.tm.context_len
        pool = self.engine.tm.builder.pool_tokens
        if pool is not None:
            room = min(room, pool)
        return max(room - len(req.token_ids), 1)

    async def generate(self, request: Request) -> Response:
        try:
            body = await read_json(request)
        except HTTPError as e:
            return out.vllm_error(e.status, e.message)
        req, error = parse_or_error(VllmGenerateRequest, body)
        if error is not None:
            return error
        try:
            req.check()
        except ValueError as e:
            return out.vllm_error(400, str(e), str(e).split(":", 1)[0])
        lora, error = self.adapter(req.model)
        if error is not None:
            return error
        sp = req.sampling_params
        context = self.engine.tm.context_len
        max_tokens = self.max_tokens(req)
        if len(req.token_ids) + max_tokens > context:
            return out.vllm_error(
                400, f"sampling_params.max_tokens: the prompt ({len(req.token_ids)} tokens) + "
                     f"max_tokens ({max_tokens}) exceeds the model's maximum context length "
                     f"({context})", "sampling_params.max_tokens")
        want = [k for k in (sp.logprobs, sp.prompt_logprobs) if k is not None]
        vocab = self.engine.tm.builder.vocab_size
        top = max([vocab if k == -1 else k for k in want], default=0)
        base_id = request.headers.get("X-Request-Id") or req.request_id
        request_id = PREFIX + base_id
        routed = self.engine.config.enable_return_routed_experts
        if routed and sp.routed_experts_prompt_start > len(req.token_ids):
            param = "sampling_params.routed_experts_prompt_start"
            return out.vllm_error(400, f"{param}: must be between 0 and the prompt length "
                                       f"({len(req.token_ids)}), inclusive", param)
        try:
            states, _ = await self.service.submit(
                input_ids=list(req.token_ids), sampling_params=sp.engine_params(max_tokens),
                return_logprob=bool(want), top_logprobs_num=top,
                logprob_start_len=0 if sp.prompt_logprobs is not None else -1,
                stream=bool(req.stream), rid=request_id, cache_salt=req.cache_salt,
                lora_path=lora, return_routed_experts=routed,
                routed_experts_start_len=sp.routed_experts_prompt_start if routed else 0)
        except ValueError as e:
            return out.vllm_error(400, str(e), str(e).split(":", 1)[0])
        if req.stream:
            return sse_response(self._stream(req, states, request_id))
        results = await self.service.collect(states, request)
        return json_response(self._response(req, states, results, request_id))

    async def abort_requests(self, request: Request) -> Response:
        """vLLM's ``/inference/v1/abort_requests``: ``{"request_ids": [...]}``, each the
        ``request_id`` a generate answer carried (or the one its request gave); every sample
        of each is aborted. 200 with an empty body."""
        try:
            body = await read_json(request)
        except HTTPError as e:
            return out.vllm_error(e.status, e.message)
        ids = body.get("request_ids")
        if ids is None:
            return out.vllm_error(400, "Missing 'request_ids' in request body", "request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return out.vllm_error(400, "request_ids: must be a list of strings", "request_ids")
        self.engine.tm.check_alive()
        for rid in ids:
            for name in {rid, rid if rid.startswith(PREFIX) else PREFIX + rid}:
                self.engine.tm.abort(rid=name)
        return Response(status_code=200)

    # -- one answer ----------------------------------------------------------------------------
    def _logprobs(self, req: VllmGenerateRequest, meta: dict[str, Any]) -> Any:
        num = req.sampling_params.logprobs
        if num is None:
            return None
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        if req.output_mode == "text":
            return out.text_logprobs(entries, tops, num, self.piece)
        return out.tokens_logprobs(entries, tops, num)

    def _choice(self, req: VllmGenerateRequest, index: int, token_ids: list[int],
                meta: dict[str, Any], text: str, final: bool, streamed: bool = False
                ) -> dict[str, Any]:
        reason = meta["finish_reason"]
        choice: dict[str, Any] = {
            "index": index, "finish_reason": out.finish_reason(reason),
            "stop_reason": out.stop_reason(reason, req.sampling_params.stop_token_ids or []),
            "token_ids": token_ids, "sampling_mask": None,
            "routed_experts": out.routed_experts_npy(meta, self.routing_shape) if final else None,
            "weight_versions": out.weight_version_spans(meta) if final else None,
            "logprobs": self._logprobs(req, meta)}
        if req.output_mode == "text":
            choice["text"] = (out.through_stop(text, reason) if not streamed
                              and req.sampling_params.include_stop_str_in_output else text)
        return choice

    def _response(self, req: VllmGenerateRequest, states: list[RequestState],
                  results: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
        choices = []
        for i, res in enumerate(results):
            choice = self._choice(req, i, list(res["output_ids"]), res["meta_info"],
                                  res["text"], True)
            choice["finish_reason"] = choice["finish_reason"] or "stop"
            choices.append(choice)
        first = results[0]["meta_info"]
        completion = sum(r["meta_info"]["completion_tokens"] for r in results)
        num = req.sampling_params.prompt_logprobs
        return {
            "request_id": request_id, "model": self.model_name, "created": int(time.time()),
            "usage": out.usage(first["prompt_tokens"], completion, first["cached_tokens"]),
            "prompt_logprobs": (out.prompt_logprobs(first, num, self.piece)
                                if num is not None else None),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(states[0].req.input_ids) if req.return_token_ids else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "output_mode": req.output_mode, "choices": choices}

    # -- streaming -----------------------------------------------------------------------------
    async def _stream(self, req: VllmGenerateRequest, states: list[RequestState],
                      request_id: str) -> AsyncIterator[bytes]:
        prompt_tokens = len(states[0].req.input_ids)
        generated = [0] * len(states)
        prompt_ids: Optional[list[int]] = (list(states[0].req.input_ids)
                                           if req.return_token_ids else None)
        cuts = [out.StopCut(req.sampling_params.include_stop_str_in_output) for _ in states]
        try:
            async with aclosing(self.service.stream(states)) as stream:
                async for i, chunk in stream:
                    meta = chunk["meta_info"]
                    ids = list(chunk["output_ids"])
                    final = meta["finish_reason"] is not None
                    text = cuts[i].delta(chunk["text"], meta["finish_reason"])
                    text_only = req.output_mode == "text" and text
                    if not (ids or final or text_only):
                        continue
                    generated[i] += len(ids)
                    event: dict[str, Any] = {
                        "request_id": request_id, "usage": None, "output_mode": req.output_mode,
                        "choices": [self._choice(req, i, ids, meta, text, final, True)]}
                    if prompt_ids is not None:
                        event["prompt_token_ids"], prompt_ids = prompt_ids, None
                        event["mm_placeholders"] = None
                    if req.continuous_usage:
                        event["usage"] = out.usage(prompt_tokens, generated[i])
                    yield sse(event)
            if req.include_usage:
                final_usage = out.usage(prompt_tokens, sum(generated))
                del final_usage["prompt_tokens_details"]
                yield sse({"request_id": request_id, "usage": final_usage,
                           "output_mode": req.output_mode, "choices": []})
        except SchedulerDeadError as e:
            yield sse({"error": {"message": str(e), "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}})
        yield SSE_DONE


class VllmTokenize:
    """``/tokenize`` and ``/detokenize`` in vLLM's shapes, on the engine's tokenizer."""

    def __init__(self, engine: Engine, service: GenerationService,
                 generate: VllmGenerate) -> None:
        self.engine = engine
        self.service = service
        self.generate = generate
        self.renderer = ChatTemplateRenderer(engine.tokenizer,
                                             engine.config.max_template_render_s)

    async def _body(self, request: Request) -> tuple[Any, Optional[Response]]:
        try:
            return await read_json(request), None
        except HTTPError as e:
            return None, out.vllm_error(e.status, e.message)

    def _render(self, req: VllmTokenizeChatRequest) -> str:
        if req.chat_template is not None or (req.chat_template_kwargs or {}).get(
                "chat_template") is not None:
            if not self.engine.config.trust_request_chat_template:
                raise ValueError("chat_template: this server renders chat with its own "
                                 "template and does not run templates sent with requests "
                                 "(start it with --trust-request-chat-template)")
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template or kwargs.pop("chat_template", None)
        return self.renderer.render(
            [m.template_dict() for m in req.messages],
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=kwargs, template=template)

    async def tokenize(self, request: Request) -> Response:
        body, error = await self._body(request)
        if error is not None:
            return error
        kind = VllmTokenizeChatRequest if isinstance(body, dict) and "messages" in body \
            else VllmTokenizeRequest
        req, error = parse_or_error(kind, body)
        if error is not None:
            return error
        _, error = self.generate.adapter(req.model)
        if error is not None:
            return error
        tok = self.engine.tokenizer
        try:
            if isinstance(req, VllmTokenizeChatRequest):
                req.check()
                text = await self.service.offload_template(self._render, req)
            else:
                text = req.prompt
        except ValueError as e:
            return out.vllm_error(400, str(e), str(e).split(":", 1)[0])
        ids = await self.service.offload(tok.encode, text,
                                         add_special_tokens=req.add_special_tokens)
        return json_response({
            "count": len(ids), "max_model_len": self.engine.tm.context_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        body, error = await self._body(request)
        if error is not None:
            return error
        req, error = parse_or_error(VllmDetokenizeRequest, body)
        if error is not None:
            return error
        _, error = self.generate.adapter(req.model)
        if error is not None:
            return error
        vocab = self.engine.tm.builder.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            return out.vllm_error(400, f"tokens: token id {bad[0]} is out of vocabulary "
                                       f"[0, {vocab})", "tokens")
        text = await self.service.offload(self.engine.tokenizer.decode, list(req.tokens))
        return json_response({"prompt": text})


def _routing_shape(engine: Engine) -> Optional[tuple[int, int]]:
    """(num_hidden_layers, num_experts_per_tok) of a model whose routing is recorded."""
    if not engine.config.enable_return_routed_experts:
        return None
    with open(os.path.join(engine.config.model_path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])


def add_vllm_generate_routes(app: FastAPI, engine: Engine, service: GenerationService,
                             admin: list[Any]) -> None:
    """Register vLLM's data routes; ``admin`` is the admin-key dependency list."""
    generate = VllmGenerate(engine, service)
    app.post("/inference/v1/generate")(generate.generate)
    app.post("/inference/v1/abort_requests")(generate.abort_requests)
    tokenize = VllmTokenize(engine, service, generate)
    app.post("/tokenize")(tokenize.tokenize)
    app.post("/detokenize")(tokenize.detokenize)
