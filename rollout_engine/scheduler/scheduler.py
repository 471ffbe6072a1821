"""The scheduler: receive -> schedule -> run -> postprocess, one step at a time.

It owns the model runner, the KV memory, every request's state and the weight state
(``weight_state.py``). It is transport-agnostic: ``handle`` takes a request or an abort,
``step`` runs one batch and returns the outputs to send; the loop in ``runtime/loop.py`` moves
messages in and out of a thread or a process. Control calls (sleep, refit, pause, ...) are not
its business: the control plane (``rollout_engine/control/``) is composed over it, and only
changes it between steps.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Optional, Union

from transformers import AutoTokenizer

from rollout_engine.config import EngineConfig
from rollout_engine.constrained.scheduling import GrammarScheduling
from rollout_engine.memory.hicache import create_prefix_cache
from rollout_engine.memory.kv_pool import PageAllocator
from rollout_engine.memory.memory_saver import create_memory_saver
from rollout_engine.memory.prefix_cache import CacheNamespace, MatchResult
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.models.forward_batch import ForwardMode
from rollout_engine.penalties import PenaltyCounts
from rollout_engine.protocol.messages import (
    AbortReq,
    BatchOutput,
    GenerateReq,
    ReqOutput,
)
from rollout_engine.sampler import sample
from rollout_engine.scheduler import policy
from rollout_engine.scheduler.batch import (
    SamplingRowsCache,
    ScheduleBatch,
    build_sampling_batch,
)
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.request import InFlight, Req, ReqState
from rollout_engine.scheduler.stop import StopChecker, eos_token_ids
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.weights.loader import weight_names

logger = logging.getLogger(__name__)

Message = Union[GenerateReq, AbortReq]


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.device = self.runner.device
        self.allocator = PageAllocator(self.runner.max_total_num_tokens, config.page_size)
        tree = create_prefix_cache(config, self.allocator, self.runner.kv_pool,
                                   self.runner.model)
        self.kv = KVManager(self.allocator, self.runner.req_to_token, tree)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
        self.eos_ids = eos_token_ids(config.model_path, tokenizer)
        self.stop_checker = StopChecker(tokenizer, self.eos_ids, self.runner.context_len)
        self.vocab_size = self.runner.arch.vocab_size
        self.penalty_counts = PenaltyCounts(self.vocab_size, self.device)
        self.sampling_rows = SamplingRowsCache()   # a decode batch's fixed sampling params
        self.grammars: GrammarScheduling[Req] = GrammarScheduling(
            config.grammar_backend, tokenizer, self.vocab_size, sorted(self.eos_ids),
            any_whitespace=not config.constrained_json_disable_any_whitespace,
            max_whitespace_cnt=config.constrained_json_max_whitespace_cnt)
        self.weights = WeightState(config.weight_version)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Optional[Req] = None
        self.inflight = InFlight()   # every request taken, until retired
        self.arrivals = 0
        self.paused = False
        self.new_token_ratio = policy.NewTokenRatio()
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "cached_tokens": 0,
                      "prompt_tokens": 0, "num_retractions": 0, "forward_passes": 0}
        self.memory_saver = create_memory_saver(self.runner.model, self.runner.kv_pool,
                                                config.enable_weights_cpu_backup, self.device,
                                                graphs=self.runner.graphs,
                                                extra_kv=tree.kv_buffers())
        self.outbox: list[ReqOutput] = []

    # -- messages ----------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateReq):
            req = Req(msg, self.arrivals)
            self.arrivals += 1
            if msg.rid in self.by_rid:
                req.finished_reason = {"type": "abort", "message": f"duplicate rid {msg.rid!r}"}
                self.outbox.append(req.make_output(full=True))
                return None
            if not self.can_run and not self.paused:
                why = self.refusal_reason()
                req.finished_reason = {"type": "abort", "message": f"request refused: {why}"}
                self.outbox.append(req.make_output(full=True))
                return None
            too_big = self._never_fits(req)
            if too_big is not None:
                req.finished_reason = {"type": "abort", "message": too_big}
                self.outbox.append(req.make_output(full=True))
                return None
            if req.constraint is not None:   # waits for its grammar off the loop
                error = self.grammars.submit(req, req.constraint)
                if error is not None:
                    req.finished_reason = {"type": "abort", "message": error}
                    self.outbox.append(req.make_output(full=True))
                    return None
                self.inflight.add(req)
                return None
            self.inflight.add(req)
            self.kv.tree.prefetch(msg.rid, req.all_ids, self.namespace_of(req))  # L3 reads
            self.waiting.append(req)
            return None
        if isinstance(msg, AbortReq):
            self.abort(msg)
            return None
        raise TypeError(f"the scheduler takes requests and aborts, not {type(msg).__name__}")

    def _never_fits(self, req: Req) -> Optional[str]:
        """Why ``req`` can never be admitted (its KV would not fit even in an empty pool), or
        None. The frontend refuses ``prompt + max_new_tokens > pool`` already; this guards the
        queue against anything that still gets here (and against retracted requests that grew),
        which would otherwise block every request queued behind it."""
        need = -(-req.seq_len // self.kv.page_size) * self.kv.page_size
        if need <= self.allocator.num_slots:
            return None
        return (f"the request needs {need} tokens of KV but the KV pool holds "
                f"{self.allocator.num_slots} (max_total_num_tokens): shorten the prompt or "
                "raise max_total_tokens")

    def namespace_of(self, req: Req) -> CacheNamespace:
        return CacheNamespace(self.weights.generation, req.extra_key)  # never the user's label

    @property
    def by_rid(self) -> dict[str, Req]:
        """The requests in flight by rid (read only: ``inflight`` adds and removes them)."""
        return self.inflight.by_rid

    @property
    def can_run(self) -> bool:
        """Paused, asleep, or holding stale weights: no forward pass may run."""
        return not (self.paused or self.memory_saver.released & {"weights", "kv_cache"}
                    or self.weights.stale)

    def refusal_reason(self) -> str:
        """Why no forward pass may run (``can_run`` is false): asleep, stale, or paused."""
        asleep = sorted(self.memory_saver.released & {"weights", "kv_cache"})
        if asleep:
            return (f"the engine is asleep (released: {asleep}); "
                    "call resume_memory_occupation first")
        if self.weights.stale:
            total = len(weight_names(self.runner.model))
            return (f"weights are stale: {len(self.weights.missing)} of {total} weights not "
                    "written since they were resumed without a CPU backup; refit them all "
                    "(update_weights_*) before generating")
        return "generation is paused"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or len(self.grammars))

    def active_reqs(self) -> list[Req]:
        reqs = list(self.running)
        if self.chunked is not None:
            reqs.append(self.chunked)
        return reqs

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> BatchOutput:
        """Run one batch (prefill if anything can be admitted, else decode)."""
        self._admit_compiled()
        batch = None if not self.can_run else (self.schedule_prefill() or self.schedule_decode())
        self.kv.tree.commit_loads()   # the step's lower-tier hits reach the device in one copy
        if batch is not None:
            self.run_batch(batch)
        elif len(self.grammars) and self.can_run:
            self.grammars.wait(timeout=0.01)   # only compiles to wait for: do not spin
        elif self.waiting and self.can_run:
            self.kv.tree.wait_prefetch(timeout=0.01)   # only storage reads to wait for
        if self.weights.flush_pending and not self.active_reqs():
            self.kv.flush()   # a refit deferred it until no request held KV
            self.weights.flush_pending = False
        out, self.outbox = self.outbox, []
        for o in out:   # never computed (refused, aborted while queued): the serving version
            o.weight_versions = o.weight_versions or [self.weights.version]
        if not self.has_work:
            self.new_token_ratio.reset()
            if self.config.debug_integrity:
                self.check_integrity()
        return BatchOutput(out)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue, each with its own state; a
        failed compile ends that request alone, with the compiler's message."""
        if not len(self.grammars):
            return
        polled = self.grammars.poll()
        for req, grammar in polled.ready:
            req.grammar = grammar.new_state()
            self.waiting.append(req)
        for req, message in polled.failed:
            req.finished_reason = {"type": "abort", "message": message}
            self._retire(req)

    def schedule_prefill(self) -> Optional[ScheduleBatch]:
        budget = min(self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        reqs: list[Req] = []
        lens: list[int] = []
        ratio = self.new_token_ratio
        # the chunked request decodes too once its prompt is in: keep its future free as well
        active = self.active_reqs()
        # what this step computes right after a cached prefix: a waiting request sharing it
        # waits a step and finds it cached (policy.shares_uncached_prefix)
        keys: set[tuple[int, ...]] = set()
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            ext = min(req.seq_len - req.kv_len, budget)
            if not self.kv.reserve(req, req.kv_len + ext):
                raise RuntimeError("KV for a chunked prefill vanished")  # reserved at admission
            reqs.append(req)
            lens.append(ext)
            budget -= ext
            # its siblings match what its earlier chunks cached: admitted beside this chunk,
            # one would compute the same tokens again
            keys.add(policy.share_key(req, req.kv_len))
            if req.kv_len + ext < req.seq_len:
                self.chunked = req
                return ScheduleBatch(ForwardMode.EXTEND, reqs, lens)
        if not self.waiting:
            return ScheduleBatch(ForwardMode.EXTEND, reqs, lens) if reqs else None
        reserved = ratio.reservation(active)   # O(batch): only when there is a queue to admit
        cands = policy.order_waiting(list(self.waiting), self.kv, self.namespace_of,
                                     self.config.schedule_policy,
                                     self.config.schedule_lpm_fallback_queue_len)
        max_running = self.runner.max_running_requests
        admitted: set[int] = set()
        for cand in cands:
            req = cand.req
            if budget <= 0 or len(self.running) + len(reqs) >= max_running:
                break
            too_big = self._never_fits(req)
            if too_big is not None:
                self._refuse_waiting(req, too_big, admitted)
                continue
            if self.kv.tree.prefetch_pending(req.rid):   # waits aside for its storage reads
                continue
            # match again: reserving KV for an earlier candidate may have evicted the node the
            # ordering match points to; between here and admit() nothing evicts (lower cache
            # tiers load their part of the match into device slots here)
            match = self.kv.match_for_admission(req, self.namespace_of(req), policy.match_cap(
                req, self.kv.page_size))
            if self.kv.tree.prefetch_pending(req.rid):   # storage reads it started: wait aside
                continue
            matched = match.matched_len
            if policy.shares_uncached_prefix(req, matched, keys):
                continue
            ext_full = req.seq_len - matched
            ext = min(ext_full, budget)
            future = ratio.expected_new_tokens(req)
            # KV for the whole prompt is taken now, even when it is prefilled in chunks
            need = -(-req.seq_len // self.kv.page_size) * self.kv.page_size - matched
            room = self.kv.available_tokens() - self._evictable_in(match)
            alone = not self.running and not reqs
            # alone, the pool is as empty as it gets: admit without the future reservation
            if need + (0 if alone else future + reserved) > room:
                break
            if not self.kv.admit(req, match, self.namespace_of(req)):
                break
            if not self.kv.reserve(req, req.seq_len):
                self.kv.release(req, cache=False)
                break
            if req.cached_tokens is None:
                req.cached_tokens = matched
                self.stats["cached_tokens"] += matched
                self.stats["prompt_tokens"] += len(req.input_ids)
            req.state = ReqState.PREFILL
            req.see_weight_version(self.weights.version)
            reqs.append(req)
            lens.append(ext)
            admitted.add(id(req))
            keys.add(policy.share_key(req, matched))
            reserved += future
            budget -= ext
            if ext < ext_full:
                self.chunked = req
                break
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens) if reqs else None

    def _evictable_in(self, match: MatchResult) -> int:
        """Tokens of a candidate's own match that count as evictable now but will be locked."""
        return 0 if match.node is None else min(match.matched_len, self.kv.tree.evictable_size())

    def _refuse_waiting(self, req: Req, message: str, admitted: set[int]) -> None:
        """Finish a waiting request that can never run; ``admitted`` drops it from the queue."""
        req.finished_reason = {"type": "abort", "message": message}
        admitted.add(id(req))
        self._retire(req)

    def schedule_decode(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        self.running.sort(key=lambda r: r.arrival)
        retracted = False
        # the common step: the free pages cover every request's next position at once
        i = len(self.running) if self.kv.reserve_next(self.running) else 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv.reserve(req, req.kv_len + 1):
                i += 1
                continue
            if len(self.running) == 1 and self.chunked is None:
                # nothing else holds KV: retracting would only recompute it into the same wall
                self._outgrown(req)
                break
            victim = self.running.pop()  # the newest request gives its KV back
            self.retract(victim)
            retracted = True
        if retracted:
            self.new_token_ratio.after_retract(self.running)
        else:
            self.new_token_ratio.decay()
        if not self.running:
            return None
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def _outgrown(self, req: Req) -> None:
        need = req.kv_len + 1
        req.finished_reason = {
            "type": "abort",
            "message": f"out of KV memory: the request needs {need} tokens of KV, more than the "
                       f"KV pool's {self.allocator.num_slots} (max_total_num_tokens); lower "
                       "max_new_tokens or raise max_total_tokens"}
        self._finish(req)

    def retract(self, req: Req) -> None:
        """Take an admitted request off the running batch (or the chunked prefill), free its
        KV and queue it first, to be recomputed (``Req.retract`` restarts its phase)."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.kv.retract(req)
        req.retract()
        self.stats["num_retractions"] += 1
        self.waiting.appendleft(req)

    def run_batch(self, batch: ScheduleBatch) -> None:
        fb = batch.to_forward_batch(self.device)
        sampling = [(r, row) for r, row in zip(batch.reqs, batch.sample_rows) if row >= 0]
        to_sample = [(r, row) for r, row in sampling if not self._finish_without_sampling(r)]
        # the grammar rows' mask is filled on a worker thread while the forward runs
        pending = self.grammars.prepare_async([r.grammar for r, _ in to_sample])
        logits = self.runner.forward(fb)
        self.stats["forward_passes"] += 1
        if batch.mode == ForwardMode.EXTEND:
            self.stats["prefill_tokens"] += sum(batch.extend_lens)
        else:
            self.stats["decode_tokens"] += len(batch.reqs)
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.kv_len += ext
        batch.record_input_logprobs(logits)
        if to_sample:
            rows = [row for _, row in to_sample]
            reqs = [r for r, _ in to_sample]
            mask = None if pending is None else pending.result()
            ended = self.grammars.stop_only_rows(mask, [
                len(r.output_ids) < r.params.min_new_tokens for r in reqs] if mask else [])
            sb = build_sampling_batch(reqs, self.vocab_size, self.eos_ids, self.device,
                                      self.penalty_counts, ended, self.sampling_rows)
            # decode samples every row in order: skip the [B, V] copy of an index
            whole = rows == list(range(logits.shape[0]))
            out = sample(logits if whole else logits[rows], sb, mask)
            counted = [(r.penalty_row, t) for r, t in zip(reqs, out.token_ids)
                       if r.penalty_row is not None]
            if counted:
                self.penalty_counts.record([row for row, _ in counted], [t for _, t in counted])
            for i, req in enumerate(reqs):
                self._append_token(req, out.token_ids[i], out.logprobs[i],
                                   out.top_logprobs[i] if out.top_logprobs else None)
        for req, row in zip(batch.reqs, batch.sample_rows):
            self._after_forward(req, batch.mode, sampled=row >= 0)

    def _finish_without_sampling(self, req: Req) -> bool:
        if req.params.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return True
        return False

    def _append_token(self, req: Req, token: int, logprob: float,
                      top: Optional[list[tuple[float, int]]]) -> None:
        req.append_output(token)
        req.see_weight_version(self.weights.version)
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            if req.top_logprobs_num and top is not None:
                req.output_top_logprobs.append(top[:req.top_logprobs_num])
        req.finished_reason = self.stop_checker.check(req)
        # the grammar's end is a stop even under ignore_eos / min_new_tokens
        if req.grammar is not None and self.grammars.advance(req.grammar, token):
            req.finished_reason = {"type": "stop", "matched": token}

    def _after_forward(self, req: Req, mode: ForwardMode, sampled: bool) -> None:
        if req.finished:
            self._finish(req)
            return
        if req.state == ReqState.PREFILL and sampled:
            req.state = ReqState.DECODE
            self.running.append(req)
        if mode == ForwardMode.EXTEND:
            self.kv.cache_prefix(req)  # siblings and later chunks can share it right away
        if req.stream and req.state == ReqState.DECODE and (
                len(req.output_ids) - req.sent_len >= self.config.stream_interval):
            self.outbox.append(req.make_output(full=False))

    def _finish(self, req: Req) -> None:
        self.kv.release(req, cache=True)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self._retire(req)

    def _retire(self, req: Req) -> None:
        """The end of every request the scheduler took (finished, aborted, refused): it holds
        no KV any more; forget it and send its last output."""
        req.state = ReqState.FINISHED
        req.grammar = None   # its own state; the compiled grammar stays cached
        self.inflight.remove(req)
        if req.penalty_row is not None:
            self.penalty_counts.give_back(req.penalty_row)
            req.penalty_row = None
        self.outbox.append(req.make_output(full=not req.stream))

    # -- abort ---------------------------------------------------------------------------------
    def abort(self, msg: AbortReq) -> int:
        """Finish the named requests (``AbortReq``) with an abort, waiting or running; returns
        how many there were."""
        targets = list(self.by_rid.values()) if msg.abort_all else (
            self.inflight.named(msg.rid) if msg.rid is not None else [])
        for req in targets:
            req.finished_reason = {"type": "abort", "message": msg.message}
            if req.state == ReqState.WAITING:
                if not self.grammars.remove(req):   # else it was waiting for its grammar
                    self.waiting.remove(req)
                    self.kv.tree.forget_prefetch(req.rid)
                self._retire(req)
            else:
                self._finish(req)
        return len(targets)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> dict[str, Any]:
        idle = not self.has_work
        report = self.kv.check_integrity(self.active_reqs(), idle=idle)
        for req in self.waiting:
            assert req.req_pool_idx is None and not req.slots, f"waiting {req.rid} holds KV"
        report["idle"] = idle
        report["time"] = time.time()
        return report

    def shutdown(self) -> None:
        """Fail whatever is still queued so no caller waits forever."""
        self.abort(AbortReq(abort_all=True, message="engine shut down"))
        self.grammars.shutdown()
        self.kv.tree.close()   # storage writes still queued reach the disk
