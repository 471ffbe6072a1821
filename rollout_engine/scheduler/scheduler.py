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
from typing import Any, Generic, Optional, TypeVar, Union

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
from rollout_engine.processed_logprobs import with_processed_logprobs
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
    record_kept,
    record_output_selected,
)
from rollout_engine.scheduler.disaggregation import create_role
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.lifecycle import RequestLifecycle
from rollout_engine.scheduler.lora_registry import create_lora_registry
from rollout_engine.scheduler.request import InFlight, Req, ReqState
from rollout_engine.scheduler.stop import StopChecker, eos_token_ids
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.weights.loader import weight_names

logger = logging.getLogger(__name__)

Message = Union[GenerateReq, AbortReq]
T = TypeVar("T")


class _Queue(Generic[T]):
    """A scheduler attribute that is its ``RequestLifecycle``'s."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, s: Scheduler, owner: type) -> T:
        return getattr(s.reqs, self.name)   # type: ignore[no-any-return]

    def __set__(self, s: Scheduler, value: T) -> None:
        setattr(s.reqs, self.name, value)


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
        # LoRA adapters: loaded versions, requests bound to them, the device pool's slots
        self.lora = create_lora_registry(config, self.runner.arch, self.runner.dtype, self.device)
        self.arrivals = 0
        self.paused = False
        # admitting nothing from the queue while the requests holding KV run to their end
        # (vLLM's pause mode "wait"; the control plane pauses once none is left)
        self.draining = False
        self.new_token_ratio = policy.NewTokenRatio()
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "cached_tokens": 0,
                      "prompt_tokens": 0, "num_retractions": 0, "forward_passes": 0}
        # every state change of a request (queues, in-flight table, outputs): lifecycle.py
        self.reqs = RequestLifecycle(self.kv, self.grammars, self.penalty_counts, self.stats,
                                     self._before_finish, self._before_retire,
                                     routing=self.runner.routing, adapters=self.lora)
        # prefill-decode disaggregation: exports a prompt's KV, or fetches and continues one
        self.pd = create_role(config, self.runner.kv_pool)
        self.reqs.parked = self.pd.unpark
        # the routing rows sleep and wake with the KV they describe
        self.memory_saver = create_memory_saver(self.runner.model, self.runner.kv_pool,
                                                config.enable_weights_cpu_backup, self.device,
                                                graphs=self.runner.graphs,
                                                extra_kv=[*tree.kv_buffers(),
                                                          self.runner.routing])

    # -- the request side: RequestLifecycle owns the queues, read and set through these -----
    waiting = _Queue[deque[Req]]("waiting")
    running = _Queue[list[Req]]("running")
    chunked = _Queue[Optional[Req]]("chunked")
    inflight = _Queue[InFlight]("inflight")
    outbox = _Queue[list[ReqOutput]]("outbox")

    def _before_finish(self, req: Req) -> None:
        """Runs as an admitted request ends, before its KV goes back (a subclass's hook)."""
        self.pd.before_finish(self, req)

    def _before_retire(self, req: Req) -> None:
        """Runs as any taken request ends (a subclass's hook)."""
        self.pd.before_retire(req)

    # -- messages ----------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateReq):
            req = Req(msg, self.arrivals)
            self.arrivals += 1
            why = self._refusal(req)
            if why is None:
                self.lora.bind(req)   # the adapter version it runs with, until it ends
                if not self.pd.take(self, req):   # a decode server fetches its KV first
                    self.reqs.take(req, self.namespace_of(req))
            else:
                self.reqs.refuse(req, why)
            return None
        if isinstance(msg, AbortReq):
            self.abort(msg)
            return None
        raise TypeError(f"the scheduler takes requests and aborts, not {type(msg).__name__}")

    def _refusal(self, req: Req) -> Optional[str]:
        """Why a new request is not taken at all, or None."""
        if req.rid in self.by_rid:
            return f"duplicate rid {req.rid!r}"
        if not self.can_run and not self.paused:
            return f"request refused: {self.refusal_reason()}"
        return self.lora.refusal(req) or self._never_fits(req)

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
        # never the user's weight label; an adapter by (name, version): a reload never matches
        return CacheNamespace(self.weights.generation, req.extra_key, req.lora_key)

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
                    "call resume_memory_occupation (vLLM: /wake_up) first")
        if self.weights.stale:
            total = len(weight_names(self.runner.model))
            return (f"weights are stale: {len(self.weights.missing)} of {total} weights not "
                    "written since they were resumed without a CPU backup; refit them all "
                    "(update_weights_*) before generating")
        return "generation is paused"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or len(self.grammars)
                    or self.pd.busy)

    def active_reqs(self) -> list[Req]:
        return self.reqs.active()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> BatchOutput:
        """Run one batch (prefill if anything can be admitted, else decode)."""
        self.reqs.grammars_compiled()
        if self.pd.busy:
            self.pd.step(self)   # fetched KV joins the decode batch
        batch = None if not self.can_run else (self.schedule_prefill() or self.schedule_decode())
        self.kv.tree.commit_loads()   # the step's lower-tier hits reach the device in one copy
        if batch is not None:
            self.run_batch(batch)
        elif len(self.grammars) and self.can_run:
            self.grammars.wait(timeout=0.01)   # only compiles to wait for: do not spin
        elif self.waiting and self.can_run:
            self.kv.tree.wait_prefetch(timeout=0.01)   # only storage reads to wait for
        elif self.pd.busy:
            self.pd.wait(timeout=0.01)   # only KV transfers to wait for
        if self.weights.flush_pending and not self.active_reqs():
            self.kv.flush()   # a refit deferred it until no request held KV
            self.weights.flush_pending = False
        out, self.outbox = self.outbox, []
        for o in out:   # no token sampled yet (queued, refused, aborted): the serving label
            if o.weight_version is None:
                o.weight_version = self.weights.version
        if not self.has_work:
            self.new_token_ratio.reset()
            if self.config.debug_integrity:
                self.check_integrity()
        return BatchOutput(out)

    def schedule_prefill(self) -> Optional[ScheduleBatch]:
        budget = min(self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        reqs: list[Req] = []
        lens: list[int] = []
        ratio = self.new_token_ratio
        # the chunked request decodes too once its prompt is in: keep its future free as well
        active = self.active_reqs()
        # what this step computes right after a cached prefix: a waiting request sharing it
        # waits a step and finds it cached (policy.shares_uncached_prefix)
        keys: set[tuple[Any, ...]] = set()
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
        if not self.waiting or self.draining:
            return ScheduleBatch(ForwardMode.EXTEND, reqs, lens) if reqs else None
        reserved = ratio.reservation(active)   # O(batch): only when there is a queue to admit
        cands = policy.order_waiting(list(self.waiting), self.kv, self.namespace_of,
                                     self.config.schedule_policy,
                                     self.config.schedule_lpm_fallback_queue_len)
        max_running = self.runner.max_running_requests
        admitted: set[int] = set()
        adapters = self.lora.budget(active)   # at most max_loras_per_batch in a batch
        for cand in cands:
            req = cand.req
            if budget <= 0 or len(self.running) + len(reqs) >= max_running:
                break
            if not adapters.admits(req):
                continue
            too_big = self._never_fits(req)
            if too_big is not None:
                self.reqs.refuse_waiting(req, too_big)
                admitted.add(id(req))   # off the queue
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
            self.reqs.admit(req, matched)
            adapters.add(req)
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
                self.reqs.outgrown(req, self.allocator.num_slots)
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

    def retract(self, req: Req) -> None:
        """Free an admitted request's KV and queue it first, to be recomputed."""
        self.reqs.retract(req)

    def run_batch(self, batch: ScheduleBatch) -> None:
        fb = batch.to_forward_batch(self.device)
        fb.lora = self.lora.prepare(batch.reqs, batch.extend_lens)
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
            if self.config.logprobs_mode == "processed_logprobs":
                out = with_processed_logprobs(out, logits if whole else logits[rows], sb, mask)
            counted = [(r.penalty_row, t) for r, t in zip(reqs, out.token_ids)
                       if r.penalty_row is not None]
            if counted:
                self.penalty_counts.record([row for row, _ in counted], [t for _, t in counted])
            record_output_selected(logits, rows, reqs)   # chosen ids' logprobs, if asked
            record_kept(out.kept, reqs)                  # kept nuclei, if asked
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
        if req.bootstrap is not None:
            self.pd.after_token(req)
        # the grammar's end is a stop even under ignore_eos / min_new_tokens
        if req.grammar is not None and self.grammars.advance(req.grammar, token):
            req.finished_reason = {"type": "stop", "matched": token}

    def _after_forward(self, req: Req, mode: ForwardMode, sampled: bool) -> None:
        if req.finished:
            self.reqs.finish(req)
            return
        if req.state == ReqState.PREFILL and sampled:
            self.reqs.decoding(req)
        if mode == ForwardMode.EXTEND:
            self.kv.cache_prefix(req)  # siblings and later chunks can share it right away
        if req.stream and req.state == ReqState.DECODE and (
                len(req.output_ids) - req.sent_len >= self.config.stream_interval):
            self.outbox.append(req.make_output(full=False))

    def abort(self, msg: AbortReq) -> int:
        """Finish the named requests (``AbortReq``) with an abort, waiting or running; returns
        how many there were."""
        return self.reqs.abort(msg)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> dict[str, Any]:
        idle = not self.has_work
        report = self.kv.check_integrity(self.active_reqs(), idle=idle)
        for req in self.waiting:
            assert req.req_pool_idx is None and not req.slots, f"waiting {req.rid} holds KV"
        self.lora.check_integrity(list(self.by_rid.values()))   # adapter users == requests
        report["idle"] = idle
        report["time"] = time.time()
        return report

    def shutdown(self) -> None:
        """Fail whatever is still queued so no caller waits forever."""
        self.abort(AbortReq(abort_all=True, message="engine shut down"))
        self.grammars.shutdown()
        self.pd.close()
        self.kv.tree.close()   # storage writes still queued reach the disk
