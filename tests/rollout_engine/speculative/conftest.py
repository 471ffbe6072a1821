"""Prompts that make n-gram speculation propose (a passage repeated) and a spec-on / spec-off
comparison helper."""

from __future__ import annotations

import random
from typing import Any

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5,
        "debug_integrity": True}
VOCAB = 512


def repeated_prompts(num: int, seed: int = 0, passage_len: int = 12) -> list[list[int]]:
    """Prompts ``noise + passage + noise + passage[:half]``: the suffix recurs in the prompt,
    so every request gets proposals from its first decode step on."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        passage = [rng.randrange(5, VOCAB) for _ in range(passage_len)]
        noise = [rng.randrange(5, VOCAB) for _ in range(3)]
        prompts.append(noise + passage + noise[:1] + passage[:passage_len // 2])
    return prompts


def run(engine: Any, prompts: list[list[int]], params: Any, **kw: Any) -> list[dict[str, Any]]:
    out = engine.generate(input_ids=prompts, sampling_params=params, **kw)
    return out if isinstance(out, list) else [out]


def spec_counts(outs: list[dict[str, Any]]) -> tuple[int, int]:
    """(verify forwards, accepted proposals) over the outputs."""
    return (sum(o["meta_info"]["spec_verify_ct"] for o in outs),
            sum(o["meta_info"]["spec_accept_token_num"] for o in outs))
