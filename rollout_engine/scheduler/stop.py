"""Finish conditions: EOS, stop token ids, stop strings, length limits."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from rollout_engine.scheduler.request import Req

_REPLACEMENT = "\ufffd"


def eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    ids: set[int] = set()
    for fname in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, fname)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class StopChecker:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = context_len

    def check(self, req: Req) -> Optional[dict[str, Any]]:
        """The finish reason after ``req``'s newest token, or None to keep going."""
        p = req.params
        token = req.output_ids[-1]
        n = len(req.output_ids)
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
                return {"type": "stop", "matched": token}
            if p.stop:
                matched = self._stop_string(req)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.seq_len >= self.context_len:
            return {"type": "length", "length": n}
        return None

    def _stop_string(self, req: Req) -> Optional[str]:
        """The stop string that the newest token completes, or None.

        Only an occurrence that ends in the newest token's text counts, so each occurrence is
        judged once, at the step that completes it: one completed below ``min_new_tokens`` is
        skipped for good (the detokenizer keeps it in the text) and never stops a later step.
        """
        stops = req.params.stop
        longest = max(len(s) for s in stops)
        skip = req.params.skip_special_tokens
        # a character can span several byte-level tokens: look back generously
        tail_ids = req.output_ids[-(4 * longest + 4):]
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=skip)
        if not any(s in tail for s in stops):
            return None
        # text before the newest token (a trailing partial character is not text yet)
        before = len(self.tokenizer.decode(tail_ids[:-1], skip_special_tokens=skip)
                     .rstrip(_REPLACEMENT))
        ends = {s: tail.find(s, max(before - len(s) + 1, 0)) for s in stops}
        hits = [(i + len(s), s) for s, i in ends.items() if i >= 0]
        return min(hits)[1] if hits else None
