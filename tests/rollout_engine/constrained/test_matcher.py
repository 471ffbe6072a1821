"""Per-request grammar state and the batch mask: the mask equals xgrammar's own, rollback and
fork, rows without a grammar stay bit-identical, vocabulary padding is masked."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xgrammar as xgr

from rollout_engine.constrained import (
    GrammarBatch,
    GrammarQueue,
    XGrammarBackend,
    apply_token_bitmask,
    make_constraint,
)
from rollout_engine.constrained.matcher import apply_token_bitmask_ref, unpack_bitmask
from tests.rollout_engine.constrained.conftest import PADDED_VOCAB

SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["ab", "cd"]},
                                           "n": {"type": "integer"}},
          "required": ["tag", "n"]}
TEXT = '{"tag": "cd", "n": -17}'


def _reference(tokenizer: Any, vocab_size: int) -> Any:
    """A matcher built by xgrammar directly, not through our backend."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    return xgr.GrammarMatcher(compiled)


def _ref_mask(matcher: Any, vocab_size: int) -> torch.Tensor:
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return unpack_bitmask(bm, vocab_size)[0]


def _mask_of(batch: GrammarBatch, state: Any) -> torch.Tensor:
    mask = batch.prepare([None, state])
    assert mask is not None and mask.rows == [1]
    return unpack_bitmask(mask.bitmask, batch.vocab_size)[1]


def test_mask_equals_xgrammar_and_the_masked_distribution(backend: XGrammarBackend,
                                                          tokenizer: Any) -> None:
    state = backend.compile(make_constraint("json_schema", SCHEMA)).result().new_state()
    ref = _reference(tokenizer, PADDED_VOCAB)
    batch = GrammarBatch(PADDED_VOCAB)
    gen = torch.Generator().manual_seed(0)
    for tok in tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]:
        allowed = _ref_mask(ref, PADDED_VOCAB)
        assert torch.equal(_mask_of(batch, state), allowed)
        assert not allowed[len(tokenizer):].any()        # padding past the tokenizer
        logits = torch.randn(2, PADDED_VOCAB, generator=gen)
        masked = logits.clone()
        batch.prepare([None, state]).apply(masked)        # type: ignore[union-attr]
        probs = torch.softmax(masked[1], -1)
        assert torch.equal(probs > 0, allowed)
        ref_probs = torch.softmax(logits[1].masked_fill(~allowed, float("-inf")), -1)
        torch.testing.assert_close(probs, ref_probs, rtol=0, atol=0)
        assert state.accept(tok) and ref.accept_token(tok)
    assert state.is_terminated()


def test_rejected_token_leaves_the_state(backend: XGrammarBackend, tokenizer: Any) -> None:
    state = backend.compile(make_constraint("json_schema", SCHEMA)).result().new_state()
    batch = GrammarBatch(PADDED_VOCAB)
    before = _mask_of(batch, state)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not state.accept(bad) and state.num_accepted == 0
    assert torch.equal(_mask_of(batch, state), before)
    with pytest.raises(RuntimeError, match="not allowed"):
        batch.advance(state, bad)


def test_rollback_restores_the_mask(backend: XGrammarBackend, tokenizer: Any) -> None:
    state = backend.compile(make_constraint("json_schema", SCHEMA)).result().new_state()
    batch = GrammarBatch(PADDED_VOCAB)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    masks = []
    for t in ids:
        masks.append(_mask_of(batch, state))
        assert not batch.advance(state, t)
    assert batch.advance(state, tokenizer.eos_token_id)      # terminated: end the request
    batch.on_retract(state, 1)
    assert not state.is_terminated() and state.is_completed()
    for k in range(len(ids), 0, -3):
        state.rollback(state.num_accepted - (k - 1))
        assert torch.equal(_mask_of(batch, state), masks[k - 1])
    with pytest.raises(ValueError, match=f"rollback: {state.num_accepted + 5} tokens, but"):
        state.rollback(state.num_accepted + 5)


def test_fork_is_independent(backend: XGrammarBackend, tokenizer: Any) -> None:
    state = backend.compile(make_constraint("json_schema", SCHEMA)).result().new_state()
    batch = GrammarBatch(PADDED_VOCAB)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for t in ids[:4]:
        state.accept(t)
    twin = state.fork()
    assert torch.equal(_mask_of(batch, twin), _mask_of(batch, state))
    here = _mask_of(batch, state)
    for t in ids[4:]:
        assert twin.accept(t)
    assert twin.accept(tokenizer.eos_token_id) and twin.is_terminated()
    assert torch.equal(_mask_of(batch, state), here) and not state.is_terminated()
    assert state.num_accepted == 4 and twin.num_accepted == len(ids) + 1


def test_a_terminated_grammar_allows_only_stop_tokens(backend: XGrammarBackend,
                                                      tokenizer: Any) -> None:
    state = backend.compile(make_constraint("regex", "ab")).result().new_state()
    for t in tokenizer.encode("ab", add_special_tokens=False) + [tokenizer.eos_token_id]:
        assert state.accept(t)
    allowed = _mask_of(GrammarBatch(PADDED_VOCAB), state)
    assert allowed.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not state.accept(5)


def test_rows_without_a_grammar_are_bit_identical(backend: XGrammarBackend) -> None:
    grammar = backend.compile(make_constraint("regex", "[a-c]+")).result()
    states = [None, grammar.new_state(), None, None, grammar.new_state(), None]
    batch = GrammarBatch(PADDED_VOCAB)
    mask = batch.prepare(states)
    assert mask is not None and mask.rows == [1, 4]
    logits = torch.randn(6, PADDED_VOCAB) * 5
    logits[0, 3] = float("nan")                # whatever is there is left as it was
    out = logits.clone()
    mask.apply(out)
    for r in (0, 2, 3, 5):
        assert out[r].view(torch.int32).equal(logits[r].view(torch.int32))
    assert torch.isfinite(out[1]).sum() == 3 and torch.isfinite(out[4]).sum() == 3
    assert batch.prepare([None, None]) is None      # no grammar rows: nothing to do


@pytest.mark.parametrize("dtype, extra", [(torch.float32, 0), (torch.float32, 37),
                                          (torch.bfloat16, 0), (torch.float16, 11)])
def test_apply_equals_the_torch_reference(dtype: torch.dtype, extra: int) -> None:
    """xgrammar's CPU kernel where it applies, the reference elsewhere; logits wider than the
    grammar's vocabulary (lm_head padding) are masked past it."""
    gen = torch.Generator().manual_seed(1)
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab + extra, generator=gen).to(dtype)
    rows = [0, 2, 3]
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows, vocab)
    apply_token_bitmask_ref(ref, bitmask, rows, vocab)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])
    assert torch.isinf(ours[rows, vocab:]).all()
    allowed = unpack_bitmask(bitmask, vocab)
    assert torch.equal(torch.isfinite(ours[rows, :vocab]), allowed[rows])


def test_prepare_async_matches_prepare(backend: XGrammarBackend, tokenizer: Any) -> None:
    grammar = backend.compile(make_constraint("json_schema", SCHEMA)).result()
    states = [grammar.new_state(), None, grammar.new_state()]
    for t in tokenizer.encode('{"tag"', add_special_tokens=False):
        states[2].accept(t)                   # type: ignore[union-attr]
    batch = GrammarBatch(PADDED_VOCAB)
    try:
        sync = batch.prepare(states)
        assert sync is not None
        sync_bits = sync.bitmask.clone()
        later = batch.prepare_async(states).result()
        assert later is not None and later.rows == [0, 2]
        assert torch.equal(later.bitmask[[0, 2]], sync_bits[[0, 2]])
        assert later.bitmask.data_ptr() != sync.bitmask.data_ptr()   # double-buffered
    finally:
        batch.shutdown()


def test_grammar_queue(backend: XGrammarBackend) -> None:
    queue: GrammarQueue[str] = GrammarQueue()
    good = backend.compile(make_constraint("regex", "x+"))
    bad = backend.compile(make_constraint("regex", "(x", "sampling_params.regex"))
    queue.add("a", good)
    queue.add("b", bad)
    queue.add("c", good)
    assert queue.remove("c") and not queue.remove("zz")
    good.result()
    with pytest.raises(ValueError):
        bad.result()
    polled = queue.poll()
    assert [r for r, _ in polled.ready] == ["a"] and polled.ready[0][1] is good.result()
    assert [r for r, _ in polled.failed] == ["b"]
    assert "sampling_params.regex: xgrammar cannot compile" in polled.failed[0][1]
    assert len(queue) == 0
