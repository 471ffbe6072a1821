"""STANDALONE speculation: a small draft model beside the target, drafting greedily.

The draft has its own weights and its own KV pool, addressed by the target's slots: slot ``s``
holds the target's K/V in the target pool and the draft's in the draft pool. So the target's
allocator, request table, radix tree, retraction and release cover the draft's KV too, with no
second bookkeeping. The invariant that makes this work: every target forward is followed by a
draft forward of the same batch (``TargetWithDraft.forward``), so wherever the target's KV is
valid (prefill, plain decode, the verify forward's accepted positions) the draft's is too, and a
radix-cache hit is a hit for both. (Not a hit in the hierarchical cache's host or storage tier,
which keeps the target's K/V only: ``EngineConfig`` refuses STANDALONE with it.)

Except where that forward would be wasted, which on a small model costs about as much as the
target's: decode steps with speculation off (a batch above ``speculative_max_batch_size``, no
proposals this step) and verify forwards (proposing already computed the draft's KV of the
accepted positions, all but the last proposal's: ``after_verify``). There the draft's forward is
skipped (``target_only``) and the requests fall behind (``DraftModel.behind``: from which
position their draft KV is missing). The draft catches up before it next reads their KV: folded
into the first step of its next proposal (one EXTEND of the missing positions and the last
token) or, for a finishing request whose KV goes into the radix tree, one EXTEND (``catch_up``).
So the invariant holds wherever the draft's KV is read or shared::

    positions    0 ........ b ............ kv_len
    target KV    [ valid                  )
    draft KV     [ valid    )[ missing    )      catch_up: one draft EXTEND of [b, kv_len)

Sleep and wake: ``SaverWithDraft`` releases and restores the draft's weights and KV with the
target's tags; draft weights that come back without a CPU backup are reloaded from the draft's
checkpoint (its startup one or its last disk refit's). Refits reach the draft by SGLang's
``selector`` and a ``draft.`` name prefix (``control/draft_refit.py``); a stale draft costs
acceptance, never exactness.

Drafting is greedy (the draft's argmax, ``num_steps`` decode steps): each proposal is a point
mass, so ``verify.py``'s rule is exact rejection sampling whatever the draft is; a bad or stale
draft (e.g. not refit with the target) lowers acceptance, never changes the outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.memory.memory_saver import MemorySaver, create_memory_saver
from rollout_engine.model_runner.attention import create_attention_backend
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.scheduler.request import Req
from rollout_engine.weights.loader import iter_safetensors, load_weights

__all__ = ["DraftModel", "SaverWithDraft", "TargetWithDraft"]


class DraftModel:
    """The draft's runner, sized like the target's KV pool and reading the target's table."""

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        path = config.speculative_draft_model_path
        assert path is not None
        draft_config = dataclasses.replace(
            config, model_path=path, tokenizer_path=None, speculative_algorithm=None,
            speculative_draft_model_path=None, speculative_num_steps=None,
            speculative_num_draft_tokens=None, disable_cuda_graph=True,
            enable_return_routed_experts=False,   # the target's forwards are the record
            max_total_tokens=target.max_total_num_tokens,
            max_running_requests=target.max_running_requests,
            context_length=target.context_len)
        self.runner = ModelRunner(draft_config)
        if self.runner.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(
                f"EngineConfig.speculative_draft_model_path: the draft's vocabulary "
                f"({self.runner.arch.vocab_size}) differs from the target's "
                f"({target.arch.vocab_size}); a draft must share the target's tokenizer")
        # the target's request table: the draft reads its K/V at the target's slots
        self.runner.req_to_token = target.req_to_token
        self.runner.attn_backend = create_attention_backend(
            draft_config.resolved_attention_backend(), self.runner.kv_pool, target.req_to_token)
        self.device = self.runner.device
        self.path = path
        self.behind: dict[int, int] = {}   # request arrival -> where its draft KV stops
        self.num_late = 0                  # positions computed by catching up

    def fall_behind(self, reqs: list[Req]) -> None:
        """``reqs`` decode a step without the draft: their draft KV stops at ``kv_len``."""
        for r in reqs:
            self.behind.setdefault(r.arrival, r.kv_len)

    def forget(self, reqs: list[Req]) -> None:
        """``reqs``' draft KV is whole again (an EXTEND with the draft computed what was not
        taken from the radix tree: a retracted request's recompute)."""
        for r in reqs:
            self.behind.pop(r.arrival, None)

    def catch_up(self, reqs: list[Req], through_last: bool = False) -> int:
        """One draft EXTEND over the positions of ``reqs`` whose draft KV is missing (and with
        ``through_last`` the last token's, whose target KV the coming step computes); returns
        how many positions it computed."""
        extra = int(through_last)
        todo = [(r, self.behind.pop(r.arrival, r.kv_len), r.kv_len + extra) for r in reqs
                if through_last or r.arrival in self.behind]
        todo = [(r, start, end) for r, start, end in todo if end > start and r.slots]
        if not todo:
            return 0
        fb = self._extend_batch(todo)
        self.runner.forward(fb)
        self.num_late += int(fb.input_ids.numel())
        return int(fb.input_ids.numel())

    def after_verify(self, req: Req, start: int, num_drafted: int) -> None:
        """A verify forward (run without the draft) took ``req`` from ``start`` to its
        ``kv_len``: proposing computed the draft's KV of ``[start, start + num_drafted)``,
        which holds the accepted tokens; the rest (the last proposal, when all held; every
        position of a row that proposed nothing) is missing."""
        if num_drafted == 0:
            self.behind.setdefault(req.arrival, start)
        elif req.kv_len > start + num_drafted:
            self.behind[req.arrival] = start + num_drafted

    def _extend_batch(self, ranges: list[tuple[Req, int, int]]) -> ForwardBatch:
        """An EXTEND of positions ``[start, end)`` per request, logits at each one's last."""
        ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        prefix, seq, ext, last = [], [], [], []
        for r, start, end in ranges:
            ids.extend(r.all_ids[start:end])
            positions.extend(range(start, end))
            out_loc.extend(r.slots[start:end])
            prefix.append(start)
            seq.append(end)
            ext.append(end - start)
            last.append(len(ids) - 1)

        def t(values: list[Any]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=t(ids), positions=t(positions),
            out_cache_loc=t(out_loc), req_pool_indices=t([r.req_pool_idx for r, _, _ in ranges]),
            seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(ext), logits_indices=t(last),
            seq_lens_list=seq, prefix_lens_list=prefix, extend_lens_list=ext)

    def reload_weights(self) -> None:
        """Read the draft's weights from its checkpoint again (after a wake without backup)."""
        load_weights(self.runner.model, iter_safetensors(self.path), require_all=True)

    def forward(self, fb: ForwardBatch) -> None:
        """Compute the draft's K/V for the positions of a target forward (logits unused)."""
        self.runner.forward(fb)

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Greedy drafts: up to ``budgets[i]`` tokens for ``reqs[i]``, one batched draft decode
        step per token. Each request must hold slots for ``kv_len + budget + 1`` positions."""
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        step = 0
        while active:
            batch = [reqs[i] for i in active]
            if step == 0 and any(r.arrival in self.behind for r in batch):
                # catching up folded into the first step: [missing positions, last token]
                fb = self._extend_batch([(r, self.behind.pop(r.arrival, r.kv_len), r.kv_len + 1)
                                         for r in batch])
                self.num_late += int(fb.input_ids.numel()) - len(batch)
            else:
                fb = self._decode_batch(batch, [drafts[i] for i in active], step)
            tokens = self.runner.forward(fb).argmax(dim=-1).tolist()
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            step += 1
            active = [i for i in active if len(drafts[i]) < budgets[i]]
        return drafts

    def _decode_batch(self, reqs: list[Req], drafts: list[list[int]], step: int
                      ) -> ForwardBatch:
        """Draft decode step ``step``: the input is the last token (step 0) or the previous
        proposal, at position ``kv_len + step``."""
        ids = [r.all_ids[r.kv_len] if step == 0 else d[-1] for r, d in zip(reqs, drafts)]
        pos = [r.kv_len + step for r in reqs]
        seq = [p + 1 for p in pos]

        def t(values: list[Any]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=t(ids), positions=t(pos),
            out_cache_loc=t([r.slots[p] for r, p in zip(reqs, pos)]),
            req_pool_indices=t([r.req_pool_idx for r in reqs]), seq_lens=t(seq),
            prefix_lens=t(pos), extend_lens=t([1] * len(reqs)),
            logits_indices=t(list(range(len(reqs)))), seq_lens_list=seq, prefix_lens_list=pos,
            extend_lens_list=[1] * len(reqs))


class TargetWithDraft:
    """The target runner, whose every forward is followed by the draft's on the same batch
    (the KV invariant above) unless inside ``target_only``; everything else is the target's."""

    def __init__(self, target: ModelRunner, draft: DraftModel) -> None:
        self.target = target
        self.draft = draft
        self.skip_draft = False

    @contextmanager
    def target_only(self) -> Iterator[None]:
        """Forwards without the draft's (the caller has marked the requests ``fall_behind``)."""
        if self.skip_draft:
            raise RuntimeError("target_only does not nest")
        self.skip_draft = True
        try:
            yield
        finally:
            self.skip_draft = False

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        logits = self.target.forward(fb)
        if not self.skip_draft:
            self.draft.forward(fb)
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


class SaverWithDraft:
    """The target's memory saver, with the draft's weights and KV released and restored under
    the same tags (``weights``, ``kv_cache``); ``released`` is the target's."""

    def __init__(self, target: MemorySaver, draft: DraftModel, weights_cpu_backup: bool) -> None:
        self.target = target
        self.draft = draft
        self.draft_saver = create_memory_saver(draft.runner.model, draft.runner.kv_pool,
                                               weights_cpu_backup, draft.device)

    @property
    def released(self) -> set[str]:
        return self.target.released

    def release(self, tags: list[str], weights_backup: Optional[bool] = None) -> int:
        return (self.target.release(tags, weights_backup)
                + self.draft_saver.release(tags, weights_backup))

    def resume(self, tags: list[str]) -> bool:
        """As ``MemorySaver.resume`` (True: the target's weights came back stale)."""
        stale = self.target.resume(tags)
        if self.draft_saver.resume(tags):
            self.draft.reload_weights()
        return stale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)
