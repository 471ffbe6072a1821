"""Per-request grammar state and the batch token mask: what the scheduler and sampler call.

Objects::

    Grammar        one compiled constraint (shared, immutable; from GrammarBackend.compile)
    GrammarState   one request's position in it (wraps xgrammar.GrammarMatcher)
    GrammarBatch   the scheduler's mask builder (one per scheduler, reused every step)
    TokenMask      one step's packed mask: bitmask [B, ceil(V / 32)] int32 + the rows it covers

Integration contract (scheduler phase; nothing here imports the scheduler)::

    submission   (frontend process) TokenizerManager builds RequestBuilder(...,
                 grammar_check=check_grammar) for --grammar-backend xgrammar (tokenizer-free:
                 the frontend compiles nothing), NoGrammarBackend().validate for none
                 (request_builder.grammar_check_for).
                 SamplingParams.constraint is the request's Constraint (None: no grammar).
    scheduler    backend = create_grammar_backend(config.grammar_backend, tokenizer,
                 model vocab_size, stop_token_ids=eos_ids); grammars = GrammarBatch(vocab)
                 (both held by scheduling.GrammarScheduling, which the scheduler calls)
    admission    fut = backend.compile(constraint); the request waits in a GrammarQueue
                 (pending.py) and enters the waiting queue once fut is done: req.grammar =
                 fut.result().new_state(); a ValueError there ends that request alone with
                 finish_reason {"type": "abort", "message": str(e)}. n > 1 siblings and radix
                 hits need nothing special: each request gets its own new_state() (the compile
                 is shared through the cache), prompt KV reuse does not touch grammar state.
    run_batch    before runner.forward:  pending = grammars.prepare_async(states)
                 where states[i] = the grammar of the request sampled from logits row i
                 (None for unconstrained rows, and for rows that do not sample this step,
                 e.g. a chunked prefill's non-final chunk); after forward:
                 mask = pending.result()  -> Optional[TokenMask] (None: no grammar rows, the
                 sampler does exactly what it does today)
    sampler      sample(logits, sb, mask): logprobs = log_softmax(logits / T) UNMASKED first
                 (returned by default, as for top-k / top-p: what a trainer recomputes);
                 then mask.keep(...) (0 / 1) weighs the probabilities sampled from (top-k /
                 top-p rows rank a -inf-masked copy; greedy rows take the best allowed
                 token). With the sampling param ``return_masked_logprobs`` the
                 returned logprob is log_softmax(masked / T) (the sampled distribution).
    postprocess  for each sampled (req, token): grammars.advance(req.grammar, token); it
                 returns True when the grammar has terminated (it accepted a stop token):
                 finish the request with {"type": "stop", "matched": token} even under
                 ignore_eos / min_new_tokens. A token the grammar refuses cannot be sampled
                 (masked); advance raises RuntimeError if it happens anyway (a bug).
                 min_new_tokens bans EOS through the penalties (batch.py); on a grammar row
                 whose mask allows only stop tokens that ban must be lifted, or every logit is
                 -inf: the grammar wins.
    retract      KV-only retraction keeps output_ids: nothing. A retraction that drops k
                 generated tokens (pause_generation(mode="retract") re-decoding them, or
                 any rollback): grammars.on_retract(req.grammar, k).
    abort/finish grammars.on_abort(req.grammar) (drops it); refit needs nothing: grammar
                 state depends on tokens, not weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from rollout_engine.constrained.spec import Constraint

__all__ = ["Grammar", "GrammarBatch", "GrammarState", "TokenMask", "apply_token_bitmask",
           "apply_token_bitmask_ref", "bitmask_width", "masked_logprobs",
           "masked_top_logprobs", "unpack_bitmask"]


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: bit ``j % 32`` of word ``j // 32`` allows token ``j``."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _unpack_float(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] float32 0 / 1, one table lookup per byte (bits in
    little-endian order: byte k of word j holds tokens 32 j + 8 k ...), ~10x faster on CPU than
    shifting every bit as ``unpack_bitmask`` does."""
    table = ((torch.arange(256, device=bitmask.device)[:, None]
              >> torch.arange(8, device=bitmask.device)) & 1).float()
    rows = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    return table.index_select(0, rows).reshape(bitmask.shape[0], -1)[:, :vocab_size]


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint; immutable and shared by every request that asks for it."""

    compiled: Any                 # xgrammar.CompiledGrammar
    constraint: Constraint
    vocab_size: int
    compile_s: float
    max_rollback_tokens: int = 200

    def new_state(self) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(self, xgr.GrammarMatcher(
            self.compiled, max_rollback_tokens=self.max_rollback_tokens))


class GrammarState:
    """One request's matcher: which tokens may come next, advanced token by token.

    Not thread-safe: one request's state is touched by one thread at a time (the mask
    worker during ``prepare_async``, the scheduler loop otherwise).
    """

    def __init__(self, grammar: Grammar, matcher: Any) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.num_accepted = 0     # tokens accepted and not rolled back

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``. A terminated grammar allows
        only its stop tokens (the request should have ended; this keeps sampling legal)."""
        if self.matcher.is_terminated():
            bitmask[row].zero_()
            for t in self.matcher.stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the grammar does not allow it."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most ``max_rollback_tokens``)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"rollback: {num_tokens} tokens, but {self.num_accepted} accepted")
        if num_tokens > self.grammar.max_rollback_tokens:
            raise ValueError(f"rollback: {num_tokens} tokens exceeds max_rollback_tokens "
                             f"({self.grammar.max_rollback_tokens})")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the request must end."""
        return bool(self.matcher.is_terminated())

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token may come next)."""
        return bool(self.matcher.is_completed())

    def fork(self) -> GrammarState:
        """An independent copy at the same position (n > 1 siblings forked mid-way)."""
        twin = GrammarState(self.grammar, self.matcher.fork())
        twin.num_accepted = self.num_accepted
        return twin


def _bit(k: int) -> int:
    return -(1 << 31) if k == 31 else 1 << k   # int32 words: bit 31 is the sign bit


@dataclass
class TokenMask:
    """One step's mask: ``bitmask[i]`` applies to logits row ``i`` for each ``i`` in ``rows``;
    the other rows of ``bitmask`` are unused (rows without a grammar pay nothing)."""

    bitmask: torch.Tensor          # [B, bitmask_width(vocab_size)] int32, CPU
    rows: list[int]
    vocab_size: int
    _device_copies: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed logits of ``rows`` to -inf, in place."""
        apply_token_bitmask(logits, self.on(logits.device), self.rows, self.vocab_size)

    def keep(self, num_rows: int, width: int, device: torch.device) -> torch.Tensor:
        """[num_rows, width] float32: 1 where a token may be sampled, 0 where not (columns
        past the grammar's vocabulary too); rows not in ``rows`` are all 1."""
        w = min(width, self.vocab_size, self.bitmask.shape[1] * 32)
        bm = self.on(device)
        if self.rows == list(range(num_rows)):
            allowed = _unpack_float(bm[:num_rows], w)
            return allowed if w == width else torch.nn.functional.pad(allowed, (0, width - w))
        out = torch.ones(num_rows, width, device=device)
        idx = torch.tensor(self.rows, device=device)
        out[idx] = 0.0
        out[idx, :w] = _unpack_float(bm.index_select(0, idx), w)
        return out

    def on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.bitmask
        key = str(device)
        if key not in self._device_copies:
            self._device_copies[key] = self.bitmask.to(device, non_blocking=True)
        return self._device_copies[key]


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                            vocab_size: Optional[int] = None) -> None:
    """Reference: unpack to bool and masked_fill -inf. Columns at or past ``vocab_size``
    (padding of the logits beyond the grammar's vocabulary) are always masked."""
    if not rows:
        return
    v = logits.shape[-1] if vocab_size is None else vocab_size
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx)
    width = min(v, logits.shape[-1], bitmask.shape[-1] * 32)
    allowed = unpack_bitmask(bitmask.index_select(0, idx.to(bitmask.device)), width)
    sub[:, :width].masked_fill_(~allowed.to(logits.device), float("-inf"))
    sub[:, width:] = float("-inf")
    logits.index_copy_(0, idx, sub)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                        vocab_size: Optional[int] = None) -> None:
    """Mask ``logits[rows]`` ([B, V] float) in place by ``bitmask[rows]``; other rows are not
    touched. xgrammar's kernel (CPU, CUDA) where it applies, else the torch reference."""
    if not rows:
        return
    v = logits.shape[-1] if vocab_size is None else vocab_size
    width = min(v, logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.dtype == torch.float32 and logits.is_contiguous():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=list(rows))
        if width < logits.shape[-1]:
            logits[torch.tensor(rows, device=logits.device), width:] = float("-inf")
        return
    apply_token_bitmask_ref(logits, bitmask, rows, vocab_size)


def masked_logprobs(logprobs: torch.Tensor, mask: TokenMask, wanted: list[int]
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, log_softmax(logits / T) over each row's allowed tokens) for the grammar rows
    in ``wanted``, before penalties (like the unmasked logprobs); None when none asks."""
    rows = [r for r in wanted if r in mask.rows]
    if not rows:
        return None
    ids = torch.tensor(rows, device=logprobs.device)
    sub = logprobs.index_select(0, ids)
    apply_token_bitmask(sub, mask.on(sub.device).index_select(0, ids), list(range(len(rows))),
                        mask.vocab_size)
    return ids, sub - torch.logsumexp(sub, dim=-1, keepdim=True)


def masked_top_logprobs(top: list[list[tuple[float, int]]], rows: list[int],
                        sub: torch.Tensor, nums: Union[int, list[int]]) -> None:
    """Top logprobs of masked-logprob rows from the masked distribution (allowed ids only)."""
    for j, r in enumerate(rows):
        k = nums if isinstance(nums, int) else nums[r]
        if k <= 0:
            continue
        vals, ids = sub[j].topk(min(k, sub.shape[1]))
        top[r] = [(v, i) for v, i in zip(vals.tolist(), ids.tolist()) if v != float("-inf")]


class GrammarBatch:
    """Builds each step's ``TokenMask`` for the scheduler (see the module docstring).

    Two bitmask buffers alternate, so the mask of step t+1 can be filled (``prepare_async``,
    a worker thread, while step t+1's forward runs) while nothing reads step t's any more.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffers: list[torch.Tensor] = [torch.empty(0, bitmask_width(vocab_size),
                                                         dtype=torch.int32)] * 2
        self._turn = 0
        self._pool: Optional[ThreadPoolExecutor] = None

    def prepare(self, states: Sequence[Optional[GrammarState]]) -> Optional[TokenMask]:
        """The mask for one step's sampled rows (``states[i]`` for logits row ``i``); None
        when no row has a grammar."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf.shape[0] < len(states):
            buf = torch.empty(max(len(states), 2 * buf.shape[0]), buf.shape[1],
                              dtype=torch.int32)
            self._buffers[self._turn] = buf
        bitmask = buf[:len(states)]
        for i in rows:
            states[i].fill_mask(bitmask, i)     # type: ignore[union-attr]
        return TokenMask(bitmask, rows, self.vocab_size)

    def prepare_async(self, states: Sequence[Optional[GrammarState]]
                      ) -> Future[Optional[TokenMask]]:
        """``prepare`` on a worker thread (xgrammar releases the GIL while filling), to
        overlap with the forward pass. Until the result is taken, the states must not be
        advanced."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self.prepare, list(states))

    @staticmethod
    def advance(state: Optional[GrammarState], token: int) -> bool:
        """Accept a sampled token; True when the grammar has terminated (end the request)."""
        if state is None:
            return False
        if not state.accept(token):
            raise RuntimeError(f"grammar {state.grammar.constraint.kind}: sampled token {token} "
                               "is not allowed by the mask that was applied")
        return state.is_terminated()

    @staticmethod
    def on_retract(state: Optional[GrammarState], num_dropped_tokens: int) -> None:
        """The request's last ``num_dropped_tokens`` outputs were dropped: roll back."""
        if state is not None and num_dropped_tokens:
            state.rollback(num_dropped_tokens)

    @staticmethod
    def on_abort(state: Optional[GrammarState]) -> None:
        """The request ended or was aborted; its state is dropped with it (nothing shared)."""

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
