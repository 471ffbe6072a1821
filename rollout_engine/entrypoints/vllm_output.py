"""Engine results in vLLM's response shapes: logprob entries, prompt logprobs, stop reasons,
weight-version spans and vLLM's error body.

Logprob entries follow vLLM's order: the sampled (or prompt) token first, then the top
candidates by rank without repeating it. A token's ``rank`` (1 = most likely) is given when the
engine's top list holds it, else null (the engine ranks only the top list). vLLM floors
``-inf`` (and NaN) at ``-9999.0`` in these shapes.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
from starlette.responses import Response

from rollout_engine.entrypoints.http_utils import json_response

FLOOR = -9999.0
Entry = list[Any]   # the engine's [logprob, token_id, text]


def clamp(logprob: Optional[float]) -> float:
    """vLLM's floor for a logprob in its response shapes (``-inf``, NaN, null -> -9999)."""
    if logprob is None or math.isnan(logprob):
        return FLOOR
    return max(logprob, FLOOR)


def routed_experts_npy(meta: dict[str, Any], shape: Optional[tuple[int, int]]
                       ) -> Optional[str]:
    """vLLM's ``routed_experts``: base64 of ``.npy`` bytes of the int32 array ``[rows,
    num_layers, top_k]`` (``np.load(io.BytesIO(base64.b64decode(s)))``), from the SGLang
    form in ``meta_info`` (raw int32 bytes, base64); None when nothing was recorded."""
    raw = meta.get("routed_experts")
    if raw is None or shape is None:
        return None
    array = np.frombuffer(base64.b64decode(raw), dtype="<i4").reshape(-1, *shape)
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def vllm_error(status: int, message: str, param: Optional[str] = None) -> Response:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return json_response({"error": {"message": message, "type": kind, "param": param,
                                    "code": status}}, status)


def ranked(token_id: int, logprob: Optional[float], tops: Optional[list[Entry]]
           ) -> list[tuple[int, float, Optional[int]]]:
    """``(token_id, logprob, rank)`` with ``token_id`` first, then ``tops`` (already in rank
    order) without it."""
    tops = tops or []
    rank = next((r for r, e in enumerate(tops, 1) if e[1] == token_id), None)
    out = [(token_id, clamp(logprob), rank)]
    out += [(e[1], clamp(e[0]), r) for r, e in enumerate(tops, 1) if e[1] != token_id]
    return out


def tokens_logprobs(entries: list[Entry], tops: Optional[list[Any]], num: int
                    ) -> dict[str, Any]:
    """``GenerateLogProbs`` of ``output_mode="tokens"``: one content entry per output token,
    its ``top_logprobs`` the first ``max(num, 1)`` of vLLM's ordered candidates (all with
    ``num == -1``). Each entry also carries ``token: "token_id:<id>"``, the placeholder older
    vLLM versions sent there, which some clients still check."""
    content = []
    for k, (lp, tid, _) in enumerate(entries):
        cands = ranked(tid, lp, tops[k] if tops else None)
        keep = cands if num == -1 else cands[:max(num, 1)]
        content.append({
            "token_id": tid, "token": f"token_id:{tid}", "logprob": cands[0][1],
            "rank": cands[0][2],
            "top_logprobs": [{"token_id": t, "logprob": v, "rank": r} for t, v, r in keep]})
    return {"content": content}


def text_logprobs(entries: list[Entry], tops: Optional[list[Any]], num: int,
                  piece: Callable[[int], str]) -> dict[str, Any]:
    """``ChatCompletionLogProbs`` of ``output_mode="text"`` (decoded tokens and their bytes)."""
    def item(tid: int, lp: float) -> dict[str, Any]:
        text = piece(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for k, (lp, tid, _) in enumerate(entries):
        cands = ranked(tid, lp, tops[k] if tops else None)
        keep = cands if num == -1 else cands[:max(num, 1)]
        content.append({**item(tid, cands[0][1]),
                        "top_logprobs": [item(t, v) for t, v, _ in keep]})
    return {"content": content}


def prompt_logprobs(meta: dict[str, Any], num: int, piece: Callable[[int], str]
                    ) -> list[Optional[dict[str, Any]]]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position a map
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt token first, then its
    ``num`` top candidates (all the engine returned with ``num == -1``)."""
    entries = meta.get("input_token_logprobs") or []
    tops = meta.get("input_top_logprobs") or []
    out: list[Optional[dict[str, Any]]] = []
    for k, (lp, tid, _) in enumerate(entries):
        if k == 0:
            out.append(None)
            continue
        top = tops[k] if k < len(tops) else None
        cut = top if num == -1 else (top or [])[:num]
        cands = ranked(tid, lp, cut)
        if num != -1 and top:
            rank = next((r for r, e in enumerate(top, 1) if e[1] == tid), None)
            cands[0] = (tid, cands[0][1], rank)
        out.append({str(t): {"logprob": v, "rank": r, "decoded_token": piece(t)}
                    for t, v, r in cands})
    return out


def stop_reason(reason: Optional[dict[str, Any]], stop_token_ids: list[int]
                ) -> Optional[Any]:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the output; None on
    EOS, length and abort."""
    if reason is None or reason.get("type") != "stop":
        return None
    matched = reason.get("matched")
    if isinstance(matched, str) or (isinstance(matched, int) and matched in stop_token_ids):
        return matched
    return None


def through_stop(text: str, reason: Optional[dict[str, Any]]) -> str:
    """vLLM's ``include_stop_str_in_output``: ``text`` (kept whole by the engine's
    ``no_stop_trim``) ends right after the stop string that finished it (the first match:
    an earlier one would have stopped the output there)."""
    matched = None if reason is None else reason.get("matched")
    if reason is None or reason.get("type") != "stop" or not isinstance(matched, str):
        return text
    at = text.find(matched)
    return text if at < 0 else text[:at + len(matched)]


class StopCut:
    """One streamed choice's text deltas under ``include_stop_str_in_output`` (``active``):
    the final delta ends right after the stop string, as ``through_stop`` cuts a whole text."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.sent = ""

    def delta(self, text: str, reason: Optional[dict[str, Any]]) -> str:
        if not self.active:
            return text
        if reason is None:
            self.sent += text
            return text
        return through_stop(self.sent + text, reason)[len(self.sent):]


def finish_reason(reason: Optional[dict[str, Any]]) -> Optional[str]:
    return None if reason is None else str(reason.get("type"))


def weight_version_spans(meta: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """vLLM's ``weight_versions``: contiguous ``{"version", "start", "end"}`` spans over the
    output tokens. The engine's spans pass through; a bare list of one label covers the whole
    output; several bare labels (boundaries unknown) give None."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    if all(isinstance(s, dict) for s in spans):
        return [{"version": str(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
                for s in spans]
    if len(spans) == 1 and isinstance(spans[0], str):
        return [{"version": spans[0], "start": 0, "end": int(meta["completion_tokens"])}]
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """vLLM's ``UsageInfo``; ``prompt_tokens_details.cached_tokens`` when the prefix cache
    served any of the prompt (as prime-rl's server reports it), else null."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": ({"cached_tokens": cached_tokens} if cached_tokens
                                      else None)}
