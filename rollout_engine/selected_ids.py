"""Logprobs of chosen token ids: the checks of SGLang's ``token_ids_logprob`` and of the
per-position ``token_ids_logprob_positions`` that on-policy distillation scores with.

``token_ids_logprob``: one list of ids (or one per prompt of a batch); every output position
reports their logprobs in ``meta_info.output_token_ids_logprobs``, and with
``logprob_start_len >= 0`` every prompt position from there in ``input_token_ids_logprobs``
(``[[logprob, id, text], ...]`` per position, null at position 0, which nothing predicts).

``token_ids_logprob_positions``: scoring a sequence (``max_new_tokens`` 0,
``logprob_start_len`` 0, ``return_logprob``): row ``p`` lists the ids whose logprobs position
``p`` reports, ``log P(x_p = id | x_<p)`` (rows of prompt positions the caller does not score
are empty; row 0 is never reported). One row per input token; a batch gives one such list per
prompt. Logprobs are ``log_softmax(logits / T)`` over the whole vocabulary, as every other
logprob the engine returns.
"""

from __future__ import annotations

from typing import Any, Optional

from rollout_engine.sampling_params import SamplingParams

MAX_CHOSEN_IDS = 4096          # ids per position
MAX_SCORED_IDS = 1 << 18       # ids over all positions of one prompt


def _ids(value: Any, vocab_size: int, field: str, limit: int = MAX_CHOSEN_IDS) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{field}: must be a list of integer token ids")
    if len(value) > limit:
        raise ValueError(f"{field}: at most {limit} ids, got {len(value)}")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return list(value)


def per_prompt_ids(value: Any, n: int, vocab_size: int) -> list[Optional[list[int]]]:
    """``token_ids_logprob`` for each of ``n`` prompts (None or ``[]``: not asked)."""
    field = "token_ids_logprob"
    if value is None or value == []:
        return [None] * n
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) != n:
            raise ValueError(f"{field}: a list of lists needs one list per prompt ({n}), "
                             f"got {len(value)}")
        return [_ids(v, vocab_size, f"{field}[{i}]") or None for i, v in enumerate(value)]
    ids = _ids(value, vocab_size, field)
    return [ids] * n


def per_prompt_positions(value: Any, n: int, single: bool, vocab_size: int
                         ) -> list[Optional[list[list[int]]]]:
    """``token_ids_logprob_positions`` for each of ``n`` prompts: ``[position][id]`` for one
    prompt, ``[prompt][position][id]`` for a batch."""
    field = "token_ids_logprob_positions"
    if value is None:
        return [None] * n
    per = [value] if single else value
    if not isinstance(per, list) or len(per) != n:
        raise ValueError(f"{field}: a batch needs one list of rows per prompt ({n})")
    out: list[Optional[list[list[int]]]] = []
    for i, rows in enumerate(per):
        where = field if single else f"{field}[{i}]"
        if not isinstance(rows, list):
            raise ValueError(f"{where}: must be a list with one list of ids per input token")
        parsed = [_ids(row, vocab_size, f"{where}[{p}]") for p, row in enumerate(rows)]
        if sum(map(len, parsed)) > MAX_SCORED_IDS:
            raise ValueError(f"{where}: at most {MAX_SCORED_IDS} ids over all positions")
        out.append(parsed)
    return out


def check_scoring(input_ids: list[int], sp: SamplingParams, return_logprob: bool,
                  logprob_start_len: int, positions: list[list[int]],
                  chosen: Optional[list[int]]) -> None:
    """Per-position ids score a sequence: nothing is generated, every position from 0."""
    field = "token_ids_logprob_positions"
    if not return_logprob:
        raise ValueError(f"{field}: needs return_logprob = true")
    if chosen is not None:
        raise ValueError(f"{field}: give it or token_ids_logprob, not both")
    if sp.max_new_tokens != 0 or sp.n != 1:
        raise ValueError(f"{field}: scores a sequence: needs max_new_tokens = 0 and n = 1")
    if logprob_start_len != 0:
        raise ValueError(f"{field}: needs logprob_start_len = 0 (one row per input token)")
    if len(positions) != len(input_ids):
        raise ValueError(f"{field}: needs one row per input token ({len(input_ids)}), "
                         f"got {len(positions)}")
