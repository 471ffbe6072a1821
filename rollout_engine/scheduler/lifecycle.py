"""A request's life inside the scheduler, every state change in one place.

::

    handle ──take──> WAITING ──admit──> PREFILL ──decoding──> DECODE ──finish──> FINISHED
      │               ^  │                 │                     │                  ^
      └──refuse───────┼──┼─────────────────┼─────────────────────┼──────────────────┘
                      │  └──abort / refuse_waiting ──────────────┼───> retire ──────┘
                      └──────── retract (KV freed, queued first) ┘

``finish`` also reads an asking request's routed experts from the routing store while its KV
(and so their rows) is still its own (``Req.routed_slots``).

``refuse``: never taken (duplicate rid, engine asleep, can never fit, bad grammar, unknown
adapter): its only output is the final one. ``retire`` is the end of every request that was
taken: it holds no KV any more, leaves ``inflight``, gives back its penalty row and sends its
last output. ``finish`` releases the KV of an admitted request (its prefix stays cached) and
retires it. ``refuse`` and ``retire`` give a request's LoRA adapter back (``adapters``), so
every path releases it exactly once. The queues (``waiting``, ``running``, ``chunked``) and
``inflight`` change only here, except the queue order the scheduling policy sets.

Hooks: ``before_finish`` and ``before_retire`` run first in those transitions (the speculative
scheduler hands the draft's KV over and publishes finished sequences there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Optional, Protocol

from rollout_engine.constrained.scheduling import GrammarScheduling
from rollout_engine.memory.prefix_cache import CacheNamespace
from rollout_engine.memory.routing_store import NoRoutingStore, RoutingStore
from rollout_engine.penalties import PenaltyCounts
from rollout_engine.protocol.messages import AbortReq, ReqOutput
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.request import InFlight, Req, ReqState

Hook = Callable[[Req], None]


class Adapters(Protocol):
    """Who holds a request's LoRA adapter (``scheduler/lora_registry.py``)."""

    def release(self, req: Req) -> None: ...


def _nothing(req: Req) -> None:
    return None


class RequestLifecycle:
    def __init__(self, kv: KVManager, grammars: GrammarScheduling[Req],
                 penalty_counts: PenaltyCounts, stats: dict[str, int],
                 before_finish: Hook = _nothing, before_retire: Hook = _nothing,
                 routing: Optional[RoutingStore] = None,
                 adapters: Optional[Adapters] = None) -> None:
        self.kv = kv
        self.adapters = adapters   # a request's adapter is released as it ends, on every path
        self.routing = routing if routing is not None else NoRoutingStore()
        self.grammars = grammars
        self.penalty_counts = penalty_counts
        self.stats = stats
        self.before_finish = before_finish
        self.before_retire = before_retire
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Optional[Req] = None
        self.inflight = InFlight()   # every request taken, until retired
        self.outbox: list[ReqOutput] = []
        # a request held aside by the disaggregation role (its KV being fetched): forgets it
        self.parked: Callable[[Req], bool] = lambda req: False

    def active(self) -> list[Req]:
        """The requests holding KV: running, and the one whose prompt is being chunked."""
        reqs = list(self.running)
        if self.chunked is not None:
            reqs.append(self.chunked)
        return reqs

    # -- arrival -------------------------------------------------------------------------------
    def refuse(self, req: Req, message: str) -> None:
        """A request never taken: its final output, an abort saying why."""
        req.finished_reason = {"type": "abort", "message": message}
        if self.adapters is not None:
            self.adapters.release(req)
        self.outbox.append(req.make_output(full=True))

    def take(self, req: Req, namespace: CacheNamespace) -> None:
        """Queue a new request: to wait for its grammar off the loop, or for admission (its
        lower-tier cache reads start now)."""
        if req.constraint is not None:
            error = self.grammars.submit(req, req.constraint)
            if error is not None:
                self.refuse(req, error)
                return
            self.inflight.add(req)
            return
        self.inflight.add(req)
        self.kv.tree.prefetch(req.rid, req.all_ids, namespace)
        self.waiting.append(req)

    def park(self, req: Req) -> None:
        """Take a new request that waits aside, not in the queue (a decode server's request
        while its KV is fetched: ``parked`` forgets it on an abort)."""
        self.inflight.add(req)

    def grammars_compiled(self) -> None:
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
            self.retire(req)

    # -- running -------------------------------------------------------------------------------
    def admit(self, req: Req, matched: int) -> None:
        """WAITING -> PREFILL (its KV is reserved; the caller takes it off the queue)."""
        if req.cached_tokens is None:   # a retracted request keeps its first count
            req.cached_tokens = matched
            self.stats["cached_tokens"] += matched
            self.stats["prompt_tokens"] += len(req.input_ids)
        req.state = ReqState.PREFILL

    def decoding(self, req: Req) -> None:
        """PREFILL -> DECODE: its prompt is in and its first token sampled."""
        req.state = ReqState.DECODE
        self.running.append(req)

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

    # -- the end -------------------------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """An admitted request ends: its KV goes back (the prefix stays cached)."""
        self.before_finish(req)
        if req.return_routed_experts:
            slots = req.routed_slots()
            if slots is not None:
                req.routed_experts = self.routing.read(slots)
        self.kv.release(req, cache=True)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.retire(req)

    def outgrown(self, req: Req, num_slots: int) -> None:
        """A lone running request whose next token does not fit in the whole pool."""
        req.finished_reason = {
            "type": "abort",
            "message": f"out of KV memory: the request needs {req.kv_len + 1} tokens of KV, "
                       f"more than the KV pool's {num_slots} (max_total_num_tokens); lower "
                       "max_new_tokens or raise max_total_tokens"}
        self.finish(req)

    def refuse_waiting(self, req: Req, message: str) -> None:
        """A queued request that can never run ends; the caller drops it from the queue."""
        req.finished_reason = {"type": "abort", "message": message}
        self.retire(req)

    def retire(self, req: Req) -> None:
        """The end of every request taken (finished, aborted, refused while queued): it holds
        no KV any more; forget it and send its last output."""
        self.before_retire(req)
        if self.adapters is not None:
            self.adapters.release(req)
        req.state = ReqState.FINISHED
        req.grammar = None   # its own state; the compiled grammar stays cached
        self.inflight.remove(req)
        if req.penalty_row is not None:
            self.penalty_counts.give_back(req.penalty_row)
            req.penalty_row = None
        self.outbox.append(req.make_output(full=not req.stream))

    def abort(self, msg: AbortReq) -> int:
        """Finish the named requests (``AbortReq``) with an abort, waiting or running; returns
        how many there were."""
        if msg.abort_all:
            targets = list(self.inflight.by_rid.values())
        elif msg.rid is None:
            targets = []
        elif msg.prefix:
            targets = self.inflight.starting(msg.rid)
        else:
            targets = self.inflight.named(msg.rid)
        for req in targets:
            req.finished_reason = (dict(msg.finished_reason) if msg.finished_reason is not None
                                   else {"type": "abort", "message": msg.message})
            if req.state == ReqState.WAITING:
                # else it was waiting for its grammar, or for its KV from a prefill server
                if not self.grammars.remove(req) and not self.parked(req):
                    self.waiting.remove(req)
                    self.kv.tree.forget_prefetch(req.rid)
                self.retire(req)
            else:
                self.finish(req)
        return len(targets)
