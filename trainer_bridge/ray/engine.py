"""One engine as a Ray actor (`EngineActor`) and the trainer's handle on it (`RayEngine`).

    trainer process                         Ray actor (a worker process Ray starts)
    RayEngine(i, actor).generate(...)  -->  EngineActor.call("generate", ...)
      ray.get(ref, timeout)                   rollout_engine.Engine (the Python API)
                                                scheduler: a child process of the actor,
                                                which exits with it

The Engine's Python API crosses Ray as it is (no HTTP port per engine). `RayEngine` has the
Engine's method names (ENGINE_METHODS), so `RolloutFleet`, `WeightSyncer` and the transports
drive it as they drive an Engine. Every call but `generate` is bounded by a timeout; a dead
actor raises `EngineActorDiedError` naming the engine; the engine's own errors (ValueError,
EngineAsleepError, ...) come back as themselves, not wrapped by Ray.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any, Optional

from rollout_engine.protocol.payload_sender import lend_named_tensors
from rollout_engine.protocol.shm_lease import ShmLease

__all__ = ["ENGINE_METHODS", "WEIGHTS", "EngineActor", "EngineActorDiedError", "RayEngine"]

# what a RayEngine forwards to its actor's Engine (the rest of the Engine stays in the actor)
ENGINE_METHODS = (
    "generate", "flush_cache", "check_integrity", "get_model_info", "get_server_info",
    "release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk",
    "update_weights_from_tensor", "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group", "get_weights_by_name", "get_weight_version",
    "update_weight_version", "pause_generation", "continue_generation", "abort_request")
# Weight calls run one at a time in the order their RayEngine sent them (a broadcast's
# receives must be posted in the trainer's order; a refit's last call must land last), in the
# actor's concurrency group WEIGHTS. Ray runs a threaded actor's tasks in any order, so each
# carries its sender's sequence number and waits for its turn: WEIGHTS has threads for the
# calls a transport keeps in flight (two) to wait while the one before them runs. Everything
# else runs in the default group, max_concurrency calls at once.
WEIGHT_METHODS = ("init_weights_update_group", "update_weights_from_distributed",
                  "destroy_weights_update_group", "update_weights_from_tensor",
                  "update_weights_from_disk")
WEIGHTS = "weights"
WEIGHTS_THREADS = 4


class EngineActor:
    """The body of one Ray actor: a `rollout_engine.Engine` built in the actor's process."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from rollout_engine import Engine

        self.engine = Engine(**engine_kwargs)
        self.turn = threading.Condition()
        self.next_seq: dict[str, int] = {}   # sender -> the sequence number that runs next

    def call_in_order(self, sender: str, seq: int, wait_s: float, method: str,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`call` for weight call `seq` of `sender`, once its calls 0 .. seq-1 have been sent
        to the engine. A weight update is sent without waiting for its answer (the engine's
        `send_call`), so the next bucket's call reaches the scheduler while this one is being
        applied; other weight calls run to the end first. A call that waits `wait_s` for a
        predecessor that never comes fails, and the sequence moves past the gap (so the
        sender's later calls are not stuck behind it)."""
        with self.turn:
            if not self.turn.wait_for(lambda: self.next_seq.get(sender, 0) >= seq, wait_s):
                missing = self.next_seq.get(sender, 0)
                self.next_seq[sender] = seq + 1
                self.turn.notify_all()
                raise TimeoutError(f"{method}: waited {wait_s:g} s for the weight call before "
                                   f"it (#{missing} of this trainer), which never came")
            if self.next_seq.get(sender, 0) > seq:   # a gap was skipped past this call
                raise TimeoutError(f"{method}: arrived after the weight calls after it")
        answer: Optional[Callable[[], Any]] = None
        try:
            if method.startswith("update_weights_from"):
                answer = self.engine.send_call(method, *args, **kwargs)
            else:
                result = self.call(method, args, kwargs)
        finally:
            with self.turn:
                self.next_seq[sender] = seq + 1
                self.turn.notify_all()
        return answer() if answer is not None else result

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`engine.<method>(*args, **kwargs)` for a method of ENGINE_METHODS."""
        if method not in ENGINE_METHODS:
            raise ValueError(f"method: {method!r} is not one of the engine's {ENGINE_METHODS}")
        if method == "generate" and kwargs.get("stream"):
            raise ValueError("stream: a Ray engine answers whole outputs; stream=False")
        return getattr(self.engine, method)(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        """Where the engine runs: actor and scheduler pids, the placement group and resources
        Ray gave the actor, its GPUs and the engine's device."""
        import ray

        context = ray.get_runtime_context()
        host = getattr(self.engine.tm, "host", None)
        return {"pid": os.getpid(), "scheduler_pid": getattr(host, "pid", None),
                "node_id": context.get_node_id(),
                "placement_group_id": context.get_placement_group_id(),
                "resources": context.get_assigned_resources(), "gpu_ids": ray.get_gpu_ids(),
                "device": str(self.engine.config.resolved_device())}

    def shutdown(self) -> None:
        self.engine.shutdown()


class EngineActorDiedError(RuntimeError):
    """An engine's Ray actor is gone (killed, crashed, or its node lost)."""


class RayEngine:
    """The trainer's handle on engine `index`'s actor: the Engine's methods (ENGINE_METHODS),
    each a blocking call bounded by `timeout_s` (none for `generate`: rollouts take what they
    take, and a dead actor still fails at once)."""

    def __init__(self, index: int, actor: Any, timeout_s: Optional[float]) -> None:
        self.index, self.actor, self.timeout_s = index, actor, timeout_s
        self.sender = uuid.uuid4().hex     # this handle's weight calls, numbered in send order
        self.seq = itertools.count()
        self.numbering = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name not in ENGINE_METHODS:
            raise AttributeError(name)

        def remote_call(*args: Any, **kwargs: Any) -> Any:
            timeout = None if name == "generate" else self.timeout_s
            ref, lease = self._submit(name, args, kwargs)
            with lease:
                return self.result(ref, name, timeout)
        return remote_call

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method` on the actor; returns its ObjectRef (`result` waits for it). The
        caller keeps an update's tensors alive until then (their handles are lent)."""
        return self._submit(method, args, kwargs)[0]

    def _submit(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[Any, ShmLease]:
        """`submit`, with the lease on the shared memory the call's payload lends (to be
        released once the call answered, whatever the answer)."""
        lease = ShmLease()
        if method == "update_weights_from_tensor":
            args, kwargs, lease = _serialized(args, kwargs)
        if method not in WEIGHT_METHODS:
            return self.actor.call.remote(method, args, kwargs), lease
        with self.numbering:
            return self.actor.call_in_order.options(concurrency_group=WEIGHTS).remote(
                self.sender, next(self.seq), self.timeout_s or 600.0, method, args,
                kwargs), lease

    def send_call(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """Send `method` now and return the wait for its answer: calls sent one after another
        from one thread reach the actor in that order (the transports send a refit's calls
        so, `transports.base.start_call`; a thread per call could reorder them)."""
        ref, lease = self._submit(method, args, kwargs)
        timeout = None if method == "generate" else self.timeout_s

        def answer() -> Any:
            with lease:
                return self.result(ref, method, timeout)
        return answer

    def result(self, ref: Any, method: str, timeout: Optional[float]) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"engine {self.index}: {method} did not answer within "
                               f"{timeout:g} s") from None
        except RayActorError as e:
            raise EngineActorDiedError(f"engine {self.index}: its Ray actor died during "
                                       f"{method} ({_first_line(e)})") from None
        except RayTaskError as e:   # the engine's own exception, without Ray's wrapping
            raise e.cause if isinstance(e.cause, Exception) else e from None

    async def async_result(self, ref: Any, method: str) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await ref
        except RayActorError as e:
            raise EngineActorDiedError(f"engine {self.index}: its Ray actor died during "
                                       f"{method} ({_first_line(e)})") from None
        except RayTaskError as e:
            raise e.cause if isinstance(e.cause, Exception) else e from None

    def __repr__(self) -> str:
        return f"RayEngine({self.index})"


def _serialized(args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any], ShmLease]:
    """update_weights_from_tensor's tensors as handles (shared memory / CUDA IPC strings), so
    only the handles cross Ray, never the bytes; the engine must be on this host. The lease
    holds the shared memory they lend."""
    tensors = args[0] if args else kwargs.pop("named_tensors")
    lease = ShmLease()
    if not (isinstance(tensors, list) and tensors and isinstance(tensors[0], str)):
        if not isinstance(tensors, (list, tuple, dict)) and not hasattr(tensors, "named_tensors"):
            tensors = list(tensors)
        text, lease = lend_named_tensors(tensors)
        tensors = [text]
    return (tensors, *args[1:]), kwargs, lease


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
