"""The speculative decode step: propose, verify in one target forward, accept, roll back KV.

Proposals come from the request's own tokens (NGRAM, ``ngram.py``) or from a draft model
(STANDALONE, ``draft.py``: its KV lives at the target's slots, computed beside every target
forward).

``SpeculativeScheduler`` is the ``Scheduler`` with its decode step replaced; prefill, admission,
retraction, stops and outputs are the base class's. One step::

    decode batch -> switched off? (too many requests, a grammar row)  -> the plain decode step
                 -> proposals per request (n-gram or draft; KV slots reserved without evicting;
                    none for a request whose acceptance has been low: gate.py)
                 -> none at all                                       -> the plain decode step
                 -> one EXTEND forward of [last token] + proposals    (verify.py)
                 -> sample every row with the request's own uniforms, accept the agreeing prefix
                 -> append token by token (stops, max_new_tokens, stream), kv_len += appended

KV of rejected proposals: their slots stay owned by the request past ``kv_len`` (never published
to the radix tree, which only takes ``[0, kv_len)``) and the next step's forward overwrites them;
retraction and release free them with the rest of the request's pages.

Requests with penalties, with ``min_new_tokens`` still to reach, or with a grammar run
without proposals: their next token depends on counts, bans or a matcher state that would have to
advance inside the verify rows (a grammar row turns the whole batch's speculation off).
"""

from __future__ import annotations

import logging
from typing import Optional

from rollout_engine.config import EngineConfig
from rollout_engine.config.speculative import SpecOptions
from rollout_engine.models.forward_batch import ForwardMode
from rollout_engine.protocol.messages import GenerateReq, SpecDecodeCounts
from rollout_engine.sampler import sample
from rollout_engine.scheduler.batch import ScheduleBatch, build_sampling_batch, uses_counts
from rollout_engine.scheduler.request import Req
from rollout_engine.scheduler.scheduler import Message, Scheduler
from rollout_engine.speculative.draft import DraftModel, SaverWithDraft, TargetWithDraft
from rollout_engine.speculative.gate import AcceptanceGate
from rollout_engine.speculative.ngram import NgramProposer
from rollout_engine.speculative.verify import accept_walk, verify_forward_batch, verify_uniforms

__all__ = ["SPEC_STATS", "SpeculativeScheduler", "create_scheduler"]

logger = logging.getLogger(__name__)

# scheduler stats this step adds (get_server_info "stats", Prometheus)
# spec_verify_steps: decode forwards with speculation on; spec_verify_rows: (request, such
# forward) pairs; spec_verify_tokens: tokens the verify forwards computed; spec_off_steps: decode
# forwards of batches that switched speculation off
# spec_off_low_accept_rows / _steps: request-steps / whole batches without proposals because
# acceptance was low (gate.py)
# spec_draft_catch_up_tokens: positions the STANDALONE draft computed late (draft.py)
SPEC_STATS = ("spec_verify_steps", "spec_verify_rows", "spec_draft_tokens",
              "spec_accepted_tokens", "spec_verify_tokens", "spec_off_steps",
              "spec_off_low_accept_rows", "spec_off_low_accept_steps",
              "spec_draft_catch_up_tokens")


def create_scheduler(config: EngineConfig) -> Scheduler:
    """The scheduler the flags ask for: speculative when ``speculative_algorithm`` is set."""
    options = SpecOptions.from_config(config)
    return Scheduler(config) if options is None else SpeculativeScheduler(config, options)


class SpeculativeScheduler(Scheduler):
    def __init__(self, config: EngineConfig, options: SpecOptions) -> None:
        super().__init__(config)
        self.spec = options
        self.proposer = NgramProposer(options.min_window, options.max_window)
        self.gate = AcceptanceGate(options.min_accept, options.probe_interval)
        self.draft: Optional[DraftModel] = None
        if options.algorithm == "STANDALONE":
            self.draft = DraftModel(config, self.runner)
            self.runner = TargetWithDraft(self.runner, self.draft)  # type: ignore[assignment]
            self.memory_saver = SaverWithDraft(  # type: ignore[assignment]
                self.memory_saver, self.draft, config.enable_weights_cpu_backup)
        self.stats.update({name: 0 for name in SPEC_STATS})

    def handle(self, msg: Message) -> None:
        super().handle(msg)
        if isinstance(msg, GenerateReq):
            req = self.by_rid.get(msg.rid)
            if req is not None and req.spec is None:   # meta_info carries spec_* from now on
                req.spec = SpecDecodeCounts()

    def _before_retire(self, req: Req) -> None:
        if self.draft is None and req.output_ids:
            self.proposer.publish(req.all_ids)    # later requests may draft from it

    def _before_finish(self, req: Req) -> None:
        if self.draft is not None:    # the tree takes the draft's KV with the target's
            if req.req_pool_idx is not None:
                self.draft.catch_up([req])
            self.draft.forget([req])

    def run_batch(self, batch: ScheduleBatch) -> None:
        self._run_batch(batch)
        if self.draft is not None:
            self.stats["spec_draft_catch_up_tokens"] = self.draft.num_late

    def _run_batch(self, batch: ScheduleBatch) -> None:
        if batch.mode != ForwardMode.DECODE:
            if self.draft is not None:
                self.draft.forget(batch.reqs)
            super().run_batch(batch)
            return
        if not self._speculates(batch.reqs):
            self.stats["spec_off_steps"] += 1
            if self.draft is None:
                super().run_batch(batch)
                return
            self._skip_draft(batch)
            return
        live = {r.arrival for r in self.running}
        self.proposer.forget(live)
        self.gate.forget(live)
        drafts, num_gated = self._proposals(batch.reqs)
        if not any(drafts):   # nothing to verify: the decode kernel is the cheaper forward
            for req in batch.reqs:
                self._count(req, 0, 0)
            self.stats["spec_verify_steps"] += 1
            if num_gated == len(batch.reqs):
                self.stats["spec_off_low_accept_steps"] += 1
            if self.draft is None:
                super().run_batch(batch)
                return
            self._skip_draft(batch)
            return
        if self.draft is None:
            self._verify(batch.reqs, drafts)
            return
        with self.runner.target_only():   # proposing computed the draft's KV (after_verify)
            self._verify(batch.reqs, drafts)

    def _skip_draft(self, batch: ScheduleBatch) -> None:
        """The plain decode step without the draft's forward (STANDALONE): the requests fall
        behind, but those this step ends (``max_new_tokens``) catch up first, in one batch,
        so their KV enters the radix tree whole without a catch-up each."""
        assert self.draft is not None
        ending = [r for r in batch.reqs if len(r.output_ids) + 1 >= r.params.max_new_tokens]
        self.draft.catch_up(ending, through_last=True)
        self.draft.fall_behind([r for r in batch.reqs if r not in ending])
        with self.runner.target_only():
            super().run_batch(batch)

    # -- planning ------------------------------------------------------------------------------
    def _speculates(self, reqs: list[Req]) -> bool:
        """Whether this decode batch speculates: small enough to gain (a verify forward costs
        about ``num_draft_tokens`` times a decode token per request once compute-bound) and no
        grammar row (the mask would have to advance inside the verify rows) and no row asking
        for chosen ids' logprobs or kept nuclei (recorded by the plain decode step)."""
        return len(reqs) <= self.spec.max_batch_size and all(
            r.grammar is None and r.token_ids_logprob is None and r.top_p_kept is None
            for r in reqs)

    def _budget(self, req: Req) -> int:
        """How many proposals ``req`` may take: none with penalties or an unmet
        ``min_new_tokens``; never past its ``max_new_tokens`` or the context."""
        p = req.params
        if uses_counts(req) or len(req.output_ids) < p.min_new_tokens:
            return 0
        return max(min(self.spec.max_proposals, p.max_new_tokens - len(req.output_ids) - 1,
                       self.runner.context_len - req.seq_len - 1), 0)

    def _reserve(self, req: Req, num: int) -> int:
        """Reserve KV slots for ``num`` proposals of ``req``; returns how many fit. Never evicts
        the prefix cache for them (a proposal is not worth a cached prefix): when the free pages
        fall short, only what the request's own pages already hold is used."""
        if num <= 0:
            return 0
        need = req.kv_len + num + 1
        pages = self.kv.pages_needed(req, need)
        if pages and not self.allocator.can_allocate(pages):
            return max(min(num, len(req.slots) - req.kv_len - 1), 0)
        return num if self.kv.reserve(req, need) else 0

    def _gated_budget(self, req: Req) -> int:
        """``_budget``, or 0 while the request's acceptance is low (``gate.py``)."""
        budget = self._budget(req)
        if budget and not self.gate.allows(req.arrival):
            self.stats["spec_off_low_accept_rows"] += 1
            if req.spec is not None:
                req.spec.off_low_accept += 1
            return 0
        return budget

    def _proposals(self, reqs: list[Req]) -> tuple[list[list[int]], int]:
        """Each request's proposals, their KV slots reserved; and how many requests the
        acceptance gate kept from proposing."""
        before = self.stats["spec_off_low_accept_rows"]
        budgets = [self._gated_budget(r) for r in reqs]
        num_gated = self.stats["spec_off_low_accept_rows"] - before
        if self.draft is not None:     # STANDALONE: slots first, then the draft decodes in them
            budgets = [self._reserve(r, b) for r, b in zip(reqs, budgets)]
            return self.draft.propose(reqs, budgets), num_gated
        drafts = []
        for req, budget in zip(reqs, budgets):
            draft = self.proposer.propose(req.arrival, req.all_ids, budget)
            drafts.append(draft[:self._reserve(req, len(draft))])
        return drafts, num_gated

    # -- the verify step -----------------------------------------------------------------------
    def _verify(self, reqs: list[Req], drafts: list[list[int]]) -> None:
        fb = verify_forward_batch(reqs, drafts, self.device)
        logits = self.runner.forward(fb)
        self.stats["forward_passes"] += 1
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_verify_tokens"] += int(fb.input_ids.numel())
        rows = [req for req, draft in zip(reqs, drafts) for _ in range(len(draft) + 1)]
        sb = build_sampling_batch(rows, self.vocab_size, self.eos_ids, self.device,
                                  self.penalty_counts)
        sb.uniforms = verify_uniforms(reqs, drafts, self.device)
        out = sample(logits, sb)
        first = 0
        counted: list[tuple[int, int]] = []
        starts = [req.kv_len for req in reqs]
        for req, draft in zip(reqs, drafts):
            got = accept_walk(out, first, draft)
            first += len(draft) + 1
            appended = self._append_accepted(req, got.tokens, got.logprobs, got.top_logprobs)
            req.kv_len += appended       # [last token] + the accepted proposals now hold K/V
            accepted = min(got.num_accepted, appended)
            self._count(req, len(draft), accepted)
            self.gate.record(req.arrival, len(draft), accepted)
            self.stats["decode_tokens"] += appended
            if req.penalty_row is not None:    # proposal-less rows only: one token each
                counted.append((req.penalty_row, got.tokens[0]))
        if counted:
            self.penalty_counts.record([r for r, _ in counted], [t for _, t in counted])
        if self.draft is not None:
            for req, draft, start in zip(reqs, drafts, starts):
                self.draft.after_verify(req, start, len(draft))
            self.draft.catch_up([r for r in reqs if r.finished])   # one batch, before the tree
        for req in reqs:
            self._after_forward(req, ForwardMode.DECODE, sampled=True)

    def _append_accepted(self, req: Req, tokens: list[int], logprobs: list[float],
                         top: Optional[list[list[tuple[float, int]]]]) -> int:
        """Append ``tokens`` one at a time until the request finishes (EOS, stop string,
        length), as the plain step would have; returns how many were appended."""
        for i, token in enumerate(tokens):
            self._append_token(req, token, logprobs[i], None if top is None else top[i])
            if req.finished:
                return i + 1
        return len(tokens)

    def _count(self, req: Req, drafted: int, accepted: int) -> None:
        if req.spec is None:
            req.spec = SpecDecodeCounts()
        req.spec.record(drafted, accepted)
        self.stats["spec_verify_rows"] += 1
        self.stats["spec_draft_tokens"] += drafted
        self.stats["spec_accepted_tokens"] += accepted
