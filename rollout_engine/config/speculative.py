"""The speculative-decoding flags of ``EngineConfig``, checked and resolved in one place.

SGLang's names: ``speculative_algorithm`` (``NGRAM``: proposals from the request's own tokens;
``STANDALONE``: a small draft model, ``speculative_draft_model_path``, drafting greedily; EAGLE
and MTP drafts are not implemented), ``speculative_num_draft_tokens`` (tokens per verify forward: the last accepted token plus
``num_draft_tokens - 1`` proposals; SGLang's NGRAM default is the max match window),
``speculative_num_steps`` (proposals per step when ``num_draft_tokens`` is not given:
``num_draft_tokens = num_steps + 1``, SGLang's rule for chain drafts; STANDALONE defaults to
3 steps), ``speculative_eagle_topk``
(1: drafts are one chain), ``speculative_ngram_{min,max}_match_window_size``. Ours:
``speculative_max_batch_size``, above which a decode batch runs without speculation; a request
whose proposals keep failing stops proposing (``LOW_ACCEPT_MIN``, re-probed every
``LOW_ACCEPT_PROBE`` steps: ``gate.py``). STANDALONE is refused with the hierarchical cache:
its lower tiers hold the target's KV only, so a prefix loaded back from them would come without
the draft's.

No imports from the engine: ``EngineConfig`` (this package's ``__init__``) calls ``check``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ALGORITHMS", "SpecOptions", "check", "normalized_algorithm"]

ALGORITHMS = ("NGRAM", "STANDALONE")
_NOT_BUILT = ("EAGLE", "EAGLE3", "NEXTN", "DFLASH")
STANDALONE_NUM_STEPS = 3
LOW_ACCEPT_MIN = 0.5       # proposals accepted per verify below which a request stops proposing
LOW_ACCEPT_PROBE = 8       # ... and proposes again after this many plain steps (``gate.py``)


def normalized_algorithm(value: Optional[str]) -> Optional[str]:
    """SGLang upper-cases the algorithm name (``SpeculativeAlgorithm.from_string``)."""
    return None if value is None else str(value).upper()


def check(cfg: Any) -> list[tuple[str, str]]:
    """(field, why) for every bad speculative flag of ``cfg`` (an ``EngineConfig``)."""
    errors: list[tuple[str, str]] = []
    algo = normalized_algorithm(cfg.speculative_algorithm)
    if algo is not None and algo not in ALGORITHMS:
        why = (f"{algo} drafts (EAGLE / MTP heads) are not implemented"
               if algo in _NOT_BUILT else "unknown algorithm")
        errors.append(("speculative_algorithm",
                       f"must be None or one of {list(ALGORITHMS)}, got {cfg.speculative_algorithm!r}"
                       f" ({why})"))
    draft = cfg.speculative_draft_model_path
    if algo == "STANDALONE" and draft is None:
        errors.append(("speculative_draft_model_path", "STANDALONE needs a draft model directory"))
    if draft is not None and algo != "STANDALONE":
        errors.append(("speculative_draft_model_path",
                       f"is used by speculative_algorithm STANDALONE only, got {algo!r}"))
    if algo == "STANDALONE" and cfg.enable_hierarchical_cache:
        # the host and storage tiers keep the target's K/V only: a prefix loaded back from
        # them would leave the draft attending to whatever its pool held at those slots
        errors.append(("speculative_algorithm",
                       "STANDALONE cannot be combined with enable_hierarchical_cache: KV loaded "
                       "back from the host or storage tier holds the target model's K/V, not "
                       "the draft's; turn off enable_hierarchical_cache (--enable-hierarchical-"
                       "cache) or use speculative_algorithm NGRAM"))
    if draft is not None and not os.path.isfile(os.path.join(str(draft), "config.json")):
        errors.append(("speculative_draft_model_path",
                       f"{draft!r} is not a Hugging Face model directory (no config.json)"))
    for name in ("speculative_num_steps", "speculative_num_draft_tokens"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            errors.append((name, f"must be >= 1 (or None: the default), got {value}"))
    if cfg.speculative_num_draft_tokens == 1:
        errors.append(("speculative_num_draft_tokens",
                       "must be >= 2: it counts the last accepted token and the proposals"))
    if cfg.speculative_eagle_topk not in (None, 1):
        errors.append(("speculative_eagle_topk",
                       f"must be None or 1 (drafts are one chain), got {cfg.speculative_eagle_topk}"))
    lo, hi = (cfg.speculative_ngram_min_match_window_size,
              cfg.speculative_ngram_max_match_window_size)
    if lo < 1:
        errors.append(("speculative_ngram_min_match_window_size", f"must be >= 1, got {lo}"))
    if hi < lo:
        errors.append(("speculative_ngram_max_match_window_size",
                       f"must be >= speculative_ngram_min_match_window_size ({lo}), got {hi}"))
    if cfg.speculative_max_batch_size < 0:
        errors.append(("speculative_max_batch_size",
                       f"must be >= 0 (0: never speculate), got {cfg.speculative_max_batch_size}"))
    return errors


@dataclass(frozen=True)
class SpecOptions:
    """What the speculative scheduler runs with, resolved from the flags."""

    algorithm: str
    num_draft_tokens: int      # per verify forward, the last accepted token included
    min_window: int
    max_window: int
    max_batch_size: int
    min_accept: float = LOW_ACCEPT_MIN
    probe_interval: int = LOW_ACCEPT_PROBE

    @property
    def max_proposals(self) -> int:
        return self.num_draft_tokens - 1

    @classmethod
    def from_config(cls, cfg: Any) -> Optional[SpecOptions]:
        """None when speculation is off."""
        algo = normalized_algorithm(cfg.speculative_algorithm)
        if algo is None:
            return None
        tokens = cfg.speculative_num_draft_tokens
        if tokens is None and cfg.speculative_num_steps:
            tokens = cfg.speculative_num_steps + 1
        elif tokens is None:
            tokens = (STANDALONE_NUM_STEPS + 1 if algo == "STANDALONE"
                      else cfg.speculative_ngram_max_match_window_size)
        return cls(algo, max(tokens, 2), cfg.speculative_ngram_min_match_window_size,
                   cfg.speculative_ngram_max_match_window_size, cfg.speculative_max_batch_size)
