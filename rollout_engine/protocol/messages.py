"""Typed messages between the frontend (Engine / HTTP) and the scheduler.

Everything that crosses the process boundary is one of these dataclasses (picklable); dicts
appear only at the JSON edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from rollout_engine.protocol.routed_experts import RoutedExperts
from rollout_engine.sampling_params import SamplingParams


# -- frontend -> scheduler -------------------------------------------------------------------
@dataclass(frozen=True)
class Bootstrap:
    """Where a decode server fetches a request's prompt KV: the prefill server's bootstrap
    ``host:port`` and the ``room`` both servers were given (one per sample)."""

    host: str
    port: int
    room: str
    # vLLM's protocol: the prefill stage ran with the router's max_tokens, so the decode
    # server computes the first token itself from the prompt's KV
    resample: bool = False


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int                       # resolved: sampling_seed, or drawn by the frontend
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1     # >= 0: also return prompt logprobs from this position
    stream: bool = False
    extra_key: Optional[str] = None
    # the caller's names this request was expanded from (``RequestBuilder.build``): a batch
    # member and an ``n > 1`` sample belong to the call's rid, and a sample of a batch prompt
    # also to that prompt's rid; aborting a group's name aborts every member
    groups: tuple[str, ...] = ()
    # logprobs of chosen token ids: the same ids at every output (and prompt) position, or,
    # for scoring a prompt, the ids of each prompt position (``token_ids_logprob_positions``)
    token_ids_logprob: Optional[list[int]] = None
    token_ids_logprob_positions: Optional[list[list[int]]] = None
    # the experts of every token fed to the model from this position on, with the final
    # output (``ReqOutput.routed_experts``; the engine must record them)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # the LoRA adapter to apply, by name (SGLang's ``lora_path``); None: the base model
    lora_name: Optional[str] = None
    # prefill-decode disaggregation (SGLang's bootstrap_host / port / room)
    bootstrap: Optional[Bootstrap] = None


@dataclass
class AbortReq:
    """Abort the request whose rid is ``rid`` and every request in the group named ``rid``
    (``GenerateReq.groups``), waiting or running; with ``prefix``, every request whose rid
    starts with ``rid``; or every request (``abort_all``). ``finished_reason`` replaces the
    aborted requests' ``{"type": "abort", "message": message}``."""

    rid: Optional[str] = None
    abort_all: bool = False
    message: str = "aborted by request"
    prefix: bool = False
    finished_reason: Optional[dict[str, Any]] = None


@dataclass
class ControlReq:
    """A control call run between batches, in arrival order. ``method`` names a control call
    (the control plane's handler table, ``control/handlers.py``); ``call_id`` pairs it with its
    ``ControlResult``. ``deadline`` (``time.time()``): when the caller stops waiting; a call
    not started by then is cancelled (answered ``cancelled``), never run behind the caller's
    back."""

    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    call_id: int = 0
    deadline: Optional[float] = None


class BusyError(RuntimeError):
    """A control call that cannot run in the engine's present state (requests in flight, a
    weight update being received, weights released): answered with HTTP 409, nothing changed."""


# -- scheduler -> frontend -------------------------------------------------------------------
@dataclass
class SpecDecodeCounts:
    """One request's speculative decoding so far (rollout_engine/speculative/scheduler.py).

    ``verify_ct``: target forwards that decoded the request with speculation on;
    ``accept_histogram[a]``: how many of them accepted ``a`` proposed tokens."""

    verify_ct: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    accept_histogram: list[int] = field(default_factory=list)
    off_low_accept: int = 0    # decode steps without proposals: its acceptance was too low

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_ct += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accept_histogram) <= accepted:
            self.accept_histogram.extend([0] * (accepted + 1 - len(self.accept_histogram)))
        self.accept_histogram[accepted] += 1

    def snapshot(self) -> SpecDecodeCounts:
        """A copy that later steps do not change (what one output carries)."""
        return replace(self, accept_histogram=list(self.accept_histogram))

    def meta_info(self, completion_tokens: int) -> dict[str, Any]:
        """SGLang's ``meta_info`` keys: ``spec_accept_length`` is completion tokens per verify
        forward (the prefill's first token included, as SGLang counts); ``spec_accept_rate`` is
        accepted / proposed tokens (SGLang divides by ``verify_ct * (num_draft_tokens - 1)``,
        the proposals of full chains; ours are counted as made)."""
        ct = self.verify_ct
        return {"spec_verify_ct": ct,
                "spec_accept_length": completion_tokens / ct if ct else 0.0,
                "spec_accept_rate": (self.accepted_tokens / self.draft_tokens
                                     if self.draft_tokens else 0.0),
                "spec_accept_token_num": self.accepted_tokens,
                "spec_draft_token_num": self.draft_tokens,
                "spec_accept_histogram": list(self.accept_histogram),
                "spec_off_low_accept_ct": self.off_low_accept}


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled under the weights labelled ``version``
    (vLLM's ``WeightVersionSpan``; the label is the engine's ``weight_version``)."""

    version: str
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass
class ReqOutput:
    """New tokens of one request since its last output (all of them when it finishes,
    for non-streaming requests)."""

    rid: str
    token_ids: list[int]
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    top_p_kept: Optional[list[list[int]]] = None   # per new token: the ids sampling kept
    finished_reason: Optional[dict[str, Any]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # the label of the weights that sampled the newest token (the serving label when none was)
    weight_version: Optional[str] = None
    # the final output only: contiguous spans over the output tokens, one per label change
    weight_spans: Optional[list[WeightVersionSpan]] = None
    spec: Optional[SpecDecodeCounts] = None   # set when the engine speculates
    # the final output of a request that asked (GenerateReq.return_routed_experts), when its
    # KV covered every token fed to the model: positions [routed_experts_start_len, end - 1)
    routed_experts: Optional[RoutedExperts] = None


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class ControlResult:
    call_id: int
    success: bool
    result: Any = None
    message: str = ""
    status: int = 200   # the HTTP status the frontend should answer with
    cancelled: bool = False   # not run: it reached the scheduler after its deadline


@dataclass(frozen=True)
class LoadReport:
    """One scheduler's load (SGLang's per-DP-rank load; we have one rank, 0)."""

    num_running_reqs: int              # incl. the one being prefilled in chunks
    num_waiting_reqs: int
    num_used_tokens: int               # KV slots owned by requests (not the evictable cache)
    num_waiting_tokens: int            # prompt + output tokens of the waiting queue
    num_waiting_uncached_tokens: int   # not yet in KV: waiting, and the chunked prompt's rest
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float              # decode tokens/s over the last window
    cache_hit_rate: float              # prompt tokens served from the radix cache, since start
    num_paused_reqs: int               # held by pause_generation
    num_retracted_reqs: int            # waiting with output already (retracted)
    total_prefill_tokens: int          # prompt tokens computed (not served from cache), since start
    weight_gb: float
    kv_cache_gb: float
    timestamp: float

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens \
            else 0.0

    @property
    def utilization(self) -> float:
        """SGLang's: max(running / max running, token usage / 0.9)."""
        return max(self.num_running_reqs / max(self.max_running_requests, 1),
                   self.token_usage / 0.9)


@dataclass
class SchedulerReady:
    """First message from a scheduler: facts the frontend needs."""

    info: dict[str, Any]


@dataclass
class SchedulerDied:
    message: str


@dataclass
class WeightSlice:
    """Rows of a weight as raw float32 bytes: the scheduler only copies them out (one memcpy);
    the frontend turns them into nested lists (``tolist``), off the scheduler loop."""

    shape: list[int]
    data: bytes

    def tolist(self) -> Any:
        import numpy as np

        return np.frombuffer(self.data, dtype=np.float32).reshape(self.shape).tolist()

