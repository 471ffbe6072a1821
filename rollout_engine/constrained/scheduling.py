"""The scheduler's grammar helper: one object holding the backend, the grammar queue and the
mask builder, so the scheduler calls a handful of verbs (see matcher.py's contract)::

    handle       submit(req, constraint)      -> None, or the error that ends req
    step         poll()                       -> Polled: ready (req, Grammar), failed (req, msg)
                 wait(timeout)                   nothing else to do: sleep until a compile ends
    run_batch    prepare_async(states)        -> Optional[Future[Optional[TokenMask]]]
                                                 (None: no row has a grammar, nothing to wait on)
    postprocess  advance(state, token)        -> True when the grammar ended
    abort        remove(req)                  -> whether req was waiting for its grammar

Generic over the request type; nothing here imports the scheduler.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Generic, Optional, TypeVar

import torch

from rollout_engine.constrained.backend import create_grammar_backend
from rollout_engine.constrained.matcher import GrammarBatch, GrammarState, TokenMask
from rollout_engine.constrained.pending import GrammarQueue, Polled
from rollout_engine.constrained.spec import Constraint

__all__ = ["GrammarScheduling", "only_stop_allowed"]

R = TypeVar("R")


class GrammarScheduling(Generic[R]):
    """``backend_name``: ``--grammar-backend``; ``tokenizer`` / ``vocab_size``: the model's
    (logits width); ``stop_token_ids``: the engine's EOS ids, which end a grammar."""

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int], *, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None) -> None:
        options: dict[str, Any] = {}
        if backend_name == "xgrammar":
            options = {"stop_token_ids": sorted(stop_token_ids), "any_whitespace": any_whitespace,
                       "max_whitespace_cnt": max_whitespace_cnt}
        self.backend = create_grammar_backend(backend_name, tokenizer, vocab_size, **options)
        self.queue: GrammarQueue[R] = GrammarQueue()
        self.batch = GrammarBatch(vocab_size)
        self.stop_token_ids = sorted(stop_token_ids)

    def __len__(self) -> int:
        return len(self.queue)

    def submit(self, req: R, constraint: Constraint) -> Optional[str]:
        """Start ``constraint``'s compile (cached) and queue ``req`` behind it; the error
        message instead when the backend refuses it outright."""
        try:
            fut = self.backend.compile(constraint)
        except ValueError as e:
            return str(e)
        self.queue.add(req, fut)
        return None

    def poll(self) -> Polled[R]:
        return self.queue.poll()

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s until some queued compile is done (the loop has nothing
        else to do; spinning would take the compile's CPU)."""
        futures = self.queue.futures()
        if futures:
            concurrent.futures.wait(futures, timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def remove(self, req: R) -> bool:
        return self.queue.remove(req)

    def prepare_async(self, states: Sequence[Optional[GrammarState]]
                      ) -> Optional[Future[Optional[TokenMask]]]:
        if all(s is None for s in states):
            return None
        return self.batch.prepare_async(states)

    def advance(self, state: Optional[GrammarState], token: int) -> bool:
        return self.batch.advance(state, token)

    def stop_only_rows(self, mask: Optional[TokenMask], banned: Sequence[bool]
                       ) -> frozenset[int]:
        """Rows of ``mask`` under a min_new_tokens EOS ban (``banned[i]``) whose grammar
        allows only stop tokens: the ban must lift there (the grammar wins)."""
        if mask is None:
            return frozenset()
        return frozenset(i for i in mask.rows
                         if banned[i] and only_stop_allowed(mask, i, self.stop_token_ids))

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "waiting": len(self.queue),
                **self.backend.stats()}

    def shutdown(self) -> None:
        self.batch.shutdown()
        self.backend.shutdown()


def only_stop_allowed(mask: TokenMask, row: int, stop_token_ids: Sequence[int]) -> bool:
    """Whether logits row ``row`` of ``mask`` allows nothing but stop tokens (a grammar at its
    end): the min_new_tokens EOS ban must not apply there, or no token is left."""
    if row not in mask.rows:
        return False
    words = mask.bitmask[row].clone()
    for t in stop_token_ids:
        if t // 32 < words.shape[0]:
            words[t // 32] &= ~torch.tensor(_bit(t % 32), dtype=torch.int32)
    return not bool(words.any())


def _bit(k: int) -> int:
    return -(1 << 31) if k == 31 else 1 << k   # int32 words: bit 31 is the sign bit
