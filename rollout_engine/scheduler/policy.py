"""Admission policy: which waiting requests enter the next prefill batch, in what order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.memory.prefix_cache import CacheNamespace, MatchResult
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.request import Req

# Requests that share this many leading tokens with one admitted in the same step wait one step,
# so the shared part is computed once and then matched from the cache (GRPO groups, n > 1).
_IN_BATCH_SHARE_TOKENS = 32
_NEW_TOKEN_CLIP = 4096
# The new-token ratio (SGLang's defaults): the expected fraction of a
# request's remaining max_new_tokens that it will still use. It starts at INIT, decays linearly to
# MIN over DECAY_STEPS decode steps while decode never runs short, and after a retraction jumps to
# what the survivors have used so far plus RETRACT_DECODE_STEPS more tokens each.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


@dataclass
class NewTokenRatio:
    """Admission keeps ``value`` x each active request's remaining budget of KV free, so decode
    rarely has to retract. Owned by the scheduler; adapts to the retractions it observes."""

    init: float = INIT_NEW_TOKEN_RATIO
    min: float = MIN_NEW_TOKEN_RATIO
    decay_steps: int = NEW_TOKEN_RATIO_DECAY_STEPS
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.value = self.init

    def reset(self) -> None:
        """Nothing is running: the next batch starts from the initial estimate."""
        self.value = self.init

    def decay(self) -> None:
        """A decode step found enough KV: lower the estimate a little."""
        self.value = max(self.value - (self.init - self.min) / self.decay_steps, self.min)

    def after_retract(self, survivors: list[Req]) -> None:
        """Decode ran short: estimate from what the surviving requests actually used, plus
        ``RETRACT_DECODE_STEPS`` more tokens each, as a fraction of their budget (at most 1,
        and never below the estimate that just proved too low)."""
        decoded = sum(len(r.output_ids) for r in survivors)
        budget = sum(r.params.max_new_tokens for r in survivors)
        ratio = (decoded + RETRACT_DECODE_STEPS * len(survivors)) / max(budget, 1)
        self.value = min(1.0, max(ratio, self.value))

    def expected_new_tokens(self, req: Req) -> int:
        """KV tokens to keep free for ``req``'s future decode steps (less the slots it already
        holds for them)."""
        left = max(req.params.max_new_tokens - len(req.output_ids), 0)
        return max(int(min(left, _NEW_TOKEN_CLIP) * self.value) - req.slots_ahead, 0)

    def reservation(self, active: list[Req]) -> int:
        return sum(self.expected_new_tokens(r) for r in active)


@dataclass
class Candidate:
    """A waiting request and its prefix match at ordering time (None in arrival order). The
    match only orders the queue: an earlier admission may evict it, so admission matches again
    before locking."""

    req: Req
    match: Optional[MatchResult] = None


def match_cap(req: Req, page_size: int) -> int:
    """How much of ``req`` may come from the cache: at least one token must be computed (its
    logits give the next token), and prompt logprobs need the positions they score."""
    cap = req.seq_len - 1
    if req.wants_input_logprobs and not req.input_logprobs_done():
        cap = min(cap, max(req.logprob_start_len - 1, 0))
    return cap // page_size * page_size


def order_waiting(waiting: list[Req], kv: KVManager, namespace_of, policy: str,
                  fallback_len: int) -> list[Candidate]:
    """Longest cached prefix first (``lpm``), falling back to arrival order (``fcfs``, no
    matching) when the queue is long enough that matching would cost more than it saves.

    A request's match is kept with the cache's change counter, its namespace and its cap, and
    redone only when one of them moved: a queue waiting on a busy decode is not re-walked
    through the tree every step."""
    if policy != "lpm" or len(waiting) > fallback_len:
        return sorted((Candidate(r) for r in waiting), key=lambda c: c.req.arrival)
    version = kv.tree.version
    cands = []
    for r in waiting:
        namespace, cap = namespace_of(r), match_cap(r, kv.page_size)
        key = (version, namespace, cap)
        if r.order_match_key != key:
            r.order_match, r.order_match_key = kv.match(r, namespace, cap), key
        cands.append(Candidate(r, r.order_match))
    cands.sort(key=lambda c: (-(c.match.matched_len if c.match else 0), c.req.arrival))
    return cands


def _share_len(req: Req, matched: int) -> int:
    return min(matched + _IN_BATCH_SHARE_TOKENS, req.seq_len - 1)


def shares_uncached_prefix(req: Req, matched: int, admitted_keys: set[tuple[Any, ...]]) -> bool:
    """True if a request admitted this step will compute the tokens right after ``req``'s
    cached prefix (GRPO siblings, repeats) with the same adapter: waiting one step turns them
    into a cache hit. The window starts at ``matched``, so a group extending a cached prefix
    is caught too."""
    n = _share_len(req, matched)
    if n - matched < 8:
        return False
    return (req.lora_key, *req.all_ids[:n]) in admitted_keys


def share_key(req: Req, matched: int) -> tuple[Any, ...]:
    """The key ``shares_uncached_prefix`` looks up, for a request admitted with ``matched``."""
    return (req.lora_key, *req.all_ids[:_share_len(req, matched)])


__all__ = ["Candidate", "CacheNamespace", "NewTokenRatio", "order_waiting", "match_cap",
           "shares_uncached_prefix", "share_key"]
