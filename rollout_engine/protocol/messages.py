"""Typed messages between the frontend (Engine / HTTP) and the scheduler.

Everything that crosses the process boundary is one of these dataclasses (picklable); dicts
appear only at the JSON edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.sampling_params import SamplingParams


# -- frontend -> scheduler -------------------------------------------------------------------
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


@dataclass
class AbortReq:
    rid: Optional[str] = None
    abort_all: bool = False
    message: str = "aborted by request"


@dataclass
class ControlReq:
    """A control call run between batches, in arrival order. ``method`` names a scheduler
    ``rpc_*`` handler; ``call_id`` pairs it with its ``ControlResult``. ``deadline``
    (``time.time()``): when the caller stops waiting; a call not started by then is cancelled
    (answered ``cancelled``), never run behind the caller's back."""

    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    call_id: int = 0
    deadline: Optional[float] = None


# -- scheduler -> frontend -------------------------------------------------------------------
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
    finished_reason: Optional[dict[str, Any]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_versions: list[str] = field(default_factory=list)


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

