"""What control calls may read and change of the scheduler's request side.

The control plane holds the scheduler only through this view (and the collaborators it is
given: runner, KV manager, allocator, memory saver, weight state); ``Scheduler`` satisfies it
structurally and never imports the control plane. Control calls run between steps, so nothing
here races a forward pass.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional, Protocol

from rollout_engine.protocol.messages import AbortReq
from rollout_engine.scheduler.request import Req


class Serving(Protocol):
    paused: bool                 # set by pause / continue and by a refit's keep_pause
    draining: bool               # no admission from the queue; running requests finish
    waiting: deque[Req]
    running: list[Req]
    chunked: Optional[Req]
    stats: dict[str, int]
    lora: Any                    # its LoRA adapters (scheduler/lora_registry.py)
    pd: Any                      # its disaggregation role (scheduler/disaggregation.py)

    @property
    def by_rid(self) -> dict[str, Req]: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def can_run(self) -> bool: ...

    def active_reqs(self) -> list[Req]:
        """The requests holding KV: running, and the one whose prompt is being chunked."""
        ...

    def abort(self, msg: AbortReq) -> int:
        """Finish the named requests with an abort; returns how many there were."""
        ...

    def retract(self, req: Req) -> None:
        """Free an admitted request's KV and queue it first, to be recomputed."""
        ...

    def refusal_reason(self) -> str:
        """Why no forward pass may run (asleep, stale weights, paused)."""
        ...

    def check_integrity(self) -> dict[str, Any]: ...
