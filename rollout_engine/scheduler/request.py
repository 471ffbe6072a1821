"""Req: one sequence's state inside the scheduler."""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from rollout_engine.constrained.matcher import GrammarState
from rollout_engine.constrained.spec import Constraint
from rollout_engine.memory.prefix_cache import MatchResult
from rollout_engine.protocol.messages import (
    GenerateReq,
    ReqOutput,
    SpecDecodeCounts,
    WeightVersionSpan,
)
from rollout_engine.protocol.routed_experts import RoutedExperts
from rollout_engine.sampling_params import SamplingParams


class ReqState(Enum):
    WAITING = "waiting"      # queued (new, or retracted and waiting to be recomputed)
    PREFILL = "prefill"      # admitted; KV being computed, possibly in chunks
    DECODE = "decode"        # running one token per step
    FINISHED = "finished"


class Req:
    """A request's tokens, KV ownership and results.

    ``all_ids`` is one list, ``input_ids + output_ids``, that every new token is appended to
    (``append_output``): per-step readers never copy the whole sequence.

    KV bookkeeping (positions of ``all_ids``)::

        | cached_len: slots held by the tree (locked) | own pages ... | unallocated
        0                                       cached_len          len(slots)
        kv_len <= len(slots): positions whose K/V are computed; a decoding request may hold
        slots past its sequence (``slots_ahead``: the rest of a decode run).
    """

    def __init__(self, msg: GenerateReq, arrival: int) -> None:
        self.rid = msg.rid
        self.groups = msg.groups
        self.input_ids = list(msg.input_ids)
        self.params: SamplingParams = msg.sampling_params
        self.seed = msg.seed
        self.return_logprob = msg.return_logprob
        self.top_logprobs_num = msg.top_logprobs_num
        self.logprob_start_len = msg.logprob_start_len
        self.stream = msg.stream
        self.extra_key = msg.extra_key
        # LoRA (scheduler/lora_registry.py): the adapter asked for; the version bound when the
        # scheduler took the request (released when it ends) and its key in the cache namespace
        self.lora_name = msg.lora_name
        # prefill-decode disaggregation: the pair's room (scheduler/disaggregation.py)
        self.bootstrap = msg.bootstrap
        self.lora: Any = None
        self.lora_key: Optional[tuple[str, int]] = None
        self.arrival = arrival
        self.state = ReqState.WAITING
        self.output_ids: list[int] = []
        self.all_ids: list[int] = list(msg.input_ids)   # kept equal to input_ids + output_ids
        self.penalty_row: Optional[int] = None   # its row of the scheduler's PenaltyCounts
        # structured output: the constraint asked for, and once compiled this request's own
        # position in it (advanced by every output token; kept through KV-only retraction)
        self.constraint: Optional[Constraint] = msg.sampling_params.constraint
        self.grammar: Optional[GrammarState] = None
        # the prefix match that ordered the queue, and the (cache version, namespace, cap) it
        # was made under: re-matched only when one of them changes (see policy.order_waiting)
        self.order_match: Optional[MatchResult] = None
        self.order_match_key: Optional[tuple[Any, ...]] = None
        # KV
        self.req_pool_idx: Optional[int] = None
        self.slots: list[int] = []
        self.cached_len = 0
        self.kv_len = 0
        self.last_node: Any = None
        self.namespace: Any = None
        # results
        self.finished_reason: Optional[dict[str, Any]] = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[Optional[float]] = []
        self.input_top_logprobs: list[Optional[list[tuple[float, int]]]] = []
        # logprobs of chosen ids (GenerateReq.token_ids_logprob / _positions)
        self.token_ids_logprob = msg.token_ids_logprob
        self.token_ids_positions = msg.token_ids_logprob_positions
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []
        # each output token's kept nucleus (custom_params.return_top_p_token_ids)
        self.top_p_kept: Optional[list[list[int]]] = (
            [] if msg.sampling_params.return_top_p_token_ids else None)
        self.input_token_ids_logprobs: list[Optional[list[tuple[float, int]]]] = []
        self.cached_tokens: Optional[int] = None   # reported: the first admission's prefix hit
        # (label, first output index) each time the sampling weights' label changed
        self.weight_starts: list[tuple[str, int]] = []
        # rollout routing replay: read from the routing store as the request ends
        self.return_routed_experts = msg.return_routed_experts
        self.routed_experts_start_len = msg.routed_experts_start_len
        self.routed_experts: Optional[RoutedExperts] = None
        self.num_retractions = 0
        self.sent_len = 0          # output tokens already streamed to the frontend
        self.spec: Optional[SpecDecodeCounts] = None   # set by the speculative scheduler

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_ids.append(token)

    # -- transitions ---------------------------------------------------------------------------
    def retract(self) -> None:
        """Back to the queue after giving back its KV (``KVManager.retract``): the tokens stay
        and are recomputed from whatever the cache then holds. Records of a phase the request
        had not finished restart with it, so the recompute does not repeat them: prompt
        logprobs still being computed (a prefill cut between chunks) start again from
        ``logprob_start_len``; finished ones, the output tokens, their logprobs and what was
        streamed of them (``sent_len``) are kept."""
        self.state = ReqState.WAITING
        self.num_retractions += 1
        if self.wants_input_logprobs and not self.input_logprobs_done():
            self.input_logprobs.clear()
            self.input_top_logprobs.clear()
            self.input_token_ids_logprobs.clear()

    # -- derived -------------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return len(self.all_ids)

    @property
    def slots_ahead(self) -> int:
        """Slots held past the sequence (the rest of a decode run, ``KVManager.decode_runs``)."""
        return max(len(self.slots) - len(self.all_ids), 0)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def wants_selected_ids(self) -> bool:
        """Logprobs of chosen token ids (flat, or per prompt position) are asked for."""
        return self.token_ids_logprob is not None or self.token_ids_positions is not None

    def routed_slots(self) -> Optional[list[int]]:
        """The KV slots of positions ``[routed_experts_start_len, seq_len - 1)``: every token
        fed to the model (the last sampled one never is) from the asked start, or None when
        its KV does not hold them all (ended while queued or part-way through its prompt)::

            all_ids:  | prompt ............... | output ......... | x |   x: the last token,
            position: 0        start        prompt_len      seq_len - 1      sampled, never fed
            rows:              [start ........................... )
        """
        end = self.seq_len - 1
        if self.req_pool_idx is None or self.kv_len < end:
            return None
        return self.slots[min(self.routed_experts_start_len, end):end]

    def input_logprobs_done(self) -> bool:
        return len(self.input_logprobs) >= len(self.input_ids) - max(self.logprob_start_len, 0)

    def see_weight_version(self, version: str) -> None:
        """The newest output token was sampled under ``version``: a span starts when the label
        differs from the last one (one tuple per change, nothing per token otherwise)."""
        if not self.weight_starts or self.weight_starts[-1][0] != version:
            self.weight_starts.append((version, len(self.output_ids) - 1))

    def weight_spans(self) -> list[WeightVersionSpan]:
        """Contiguous ``[start, end)`` spans over the output tokens, one per label::

            weight_starts: (v1, 0) (v2, 5)   output_ids: 8 tokens
            spans:         v1 [0, 5)  v2 [5, 8)
        """
        starts = self.weight_starts
        ends = [start for _, start in starts[1:]] + [len(self.output_ids)]
        return [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends)]

    def make_output(self, full: bool) -> ReqOutput:
        """Tokens since the last output (or all for ``full``), with their logprobs."""
        start = 0 if full else self.sent_len
        out = ReqOutput(
            rid=self.rid,
            token_ids=self.output_ids[start:],
            finished_reason=self.finished_reason,
            prompt_tokens=len(self.input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens or 0,
            weight_version=self.weight_starts[-1][0] if self.weight_starts else None,
            weight_spans=self.weight_spans() if self.finished else None,
            spec=None if self.spec is None else self.spec.snapshot(),
        )
        if self.return_logprob:
            out.output_logprobs = self.output_logprobs[start:]
            if self.top_logprobs_num:
                out.output_top_logprobs = self.output_top_logprobs[start:]
            if self.token_ids_logprob is not None:
                out.output_token_ids_logprobs = self.output_token_ids_logprobs[start:]
            if self.logprob_start_len >= 0 and (full or start == 0):
                out.input_logprobs = list(self.input_logprobs)
                if self.top_logprobs_num:
                    out.input_top_logprobs = list(self.input_top_logprobs)
                if self.wants_selected_ids:
                    out.input_token_ids_logprobs = list(self.input_token_ids_logprobs)
        if self.top_p_kept is not None:
            out.top_p_kept = self.top_p_kept[start:]
        if self.finished:
            out.routed_experts = self.routed_experts
        self.sent_len = len(self.output_ids)
        return out


class InFlight:
    """The scheduler's requests from arrival to retirement, by rid and by group
    (``GenerateReq.groups``): an abort names one rid or a whole group."""

    def __init__(self) -> None:
        self.by_rid: dict[str, Req] = {}
        self._groups: dict[str, dict[str, Req]] = {}

    def add(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        for name in req.groups:
            self._groups.setdefault(name, {})[req.rid] = req

    def remove(self, req: Req) -> None:
        if self.by_rid.get(req.rid) is not req:
            return
        del self.by_rid[req.rid]
        for name in req.groups:
            members = self._groups[name]
            del members[req.rid]
            if not members:
                del self._groups[name]

    def starting(self, prefix: str) -> list[Req]:
        """The requests whose rid starts with ``prefix``."""
        return [req for rid, req in self.by_rid.items() if rid.startswith(prefix)]

    def named(self, name: str) -> list[Req]:
        """The request whose rid is ``name`` and the members of the group ``name``."""
        found = dict(self._groups.get(name, {}))
        req = self.by_rid.get(name)
        if req is not None:
            found[req.rid] = req
        return list(found.values())
