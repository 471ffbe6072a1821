"""verl's generate call <-> the engine's /generate: the request body and the TokenOutput.

The rules are verl's for its SGLang server (read from verl 0.9.1): ``max_new_tokens`` (or
vLLM's ``max_tokens``) from the sampling params, else ``response_length`` capped by what is
left of ``prompt_length + response_length``; always within ``max_model_len - len(prompt) - 1``.
``logprobs`` (truthy) asks for the sampled tokens' logprobs; ``prompt_logprobs=K`` for the
prompt's (K > 0: the top K per position), returned as verl's ``prompt_ids`` /
``prompt_logprobs`` extra fields: one row per prompt position after the first, then a row of
zeros, K (at least 1) entries a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import TokenOutput

__all__ = ["GenerateRequest", "generate_body", "token_output"]

_MULTIMODAL = ("image_data", "video_data", "audio_data", "mm_processor_kwargs")


@dataclass(frozen=True)
class GenerateRequest:
    """A /generate body and what reading its answer needs."""

    body: dict[str, Any]
    prompt_len: int
    return_logprob: bool
    prompt_logprobs: Optional[int]


def generate_body(prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                  config: RolloutConfig, **inputs: Any) -> GenerateRequest:
    """The /generate body of one verl request. ValueError for a prompt that leaves no room in
    ``max_model_len``, for multimodal inputs and for arguments verl's servers do not take."""
    extra = {k: v for k, v in inputs.items() if v is not None and v != {} and v != []}
    mm = sorted(k for k in extra if k in _MULTIMODAL)
    if mm:
        raise ValueError(f"rollout_engine serves text-only models; got {', '.join(mm)}")
    if extra:
        raise ValueError(f"rollout_engine's generate takes no {', '.join(sorted(extra))}")
    ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
    room = config.max_model_len - len(ids) - 1
    if room < 0:
        raise ValueError(f"prompt length ({len(ids)}) exceeds max_model_len "
                         f"({config.max_model_len})")
    params = dict(sampling_params)
    if "max_new_tokens" in params:
        max_new = params.pop("max_new_tokens")
    elif "max_tokens" in params:
        max_new = params.pop("max_tokens")
    else:
        max_new = min(config.response_length,
                      config.prompt_length + config.response_length - len(ids))
    params["max_new_tokens"] = max(0, min(int(max_new), room))
    return_logprob = bool(params.pop("logprobs", False))
    prompt_logprobs = params.pop("prompt_logprobs", None)
    body: dict[str, Any] = {"rid": request_id, "input_ids": ids, "sampling_params": params}
    if prompt_logprobs is not None:
        prompt_logprobs = int(prompt_logprobs)
        if prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {prompt_logprobs}")
        body["logprob_start_len"] = 0
        if prompt_logprobs > 0:
            body["top_logprobs_num"] = prompt_logprobs
    body["return_logprob"] = return_logprob or prompt_logprobs is not None
    return GenerateRequest(body, len(ids), return_logprob, prompt_logprobs)


def global_steps(weight_version: Any) -> Optional[int]:
    """The trainer step a weight version names ("12" -> 12), else None ("default")."""
    if isinstance(weight_version, str) and weight_version.isdigit():
        return int(weight_version)
    return None


def token_output(answer: dict[str, Any], request: GenerateRequest) -> TokenOutput:
    """The engine's /generate answer as verl's TokenOutput. RuntimeError if the engine's
    logprobs do not cover its tokens (never expected; the request id is named)."""
    meta = answer.get("meta_info", {})
    token_ids = [int(t) for t in answer.get("output_ids", [])]
    log_probs: Optional[list[float]] = None
    if request.return_logprob:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(token_ids):
            raise RuntimeError(f"request {request.body['rid']}: {len(entries)} logprobs for "
                               f"{len(token_ids)} tokens")
        log_probs = [float(e[0]) for e in entries]
    finish = (meta.get("finish_reason") or {}).get("type")
    stop_reason = {"abort": "aborted", "stop": "completed", "length": "completed"}.get(
        finish, finish)
    extra: dict[str, Any] = {"global_steps": global_steps(meta.get("weight_version"))}
    if request.prompt_logprobs is not None:
        extra.update(_prompt_rows(meta, request.prompt_logprobs, request.prompt_len))
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason,
                       extra_fields=extra)


def _prompt_rows(meta: dict[str, Any], k: int, prompt_len: int) -> dict[str, list]:
    """verl's prompt_ids / prompt_logprobs: position 0 has no logprob and is skipped; a zero
    row at the end keeps the length equal to the prompt's."""
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    if k == 0:
        for logprob, token, _ in (meta.get("input_token_logprobs") or [])[1:]:
            ids.append([int(token)])
            logprobs.append([float(logprob)])
    else:
        for row in (meta.get("input_top_logprobs") or [])[1:]:
            if len(row) != k:
                raise RuntimeError(f"{len(row)} top prompt logprobs at a position, asked {k}")
            ids.append([int(token) for _, token, _ in row])
            logprobs.append([float(logprob) for logprob, _, _ in row])
    width = max(k, 1)
    ids.append([0] * width)
    logprobs.append([0.0] * width)
    if len(ids) != prompt_len:
        raise RuntimeError(f"{len(ids)} prompt logprob rows for a prompt of {prompt_len}")
    return {"prompt_ids": ids, "prompt_logprobs": logprobs}
