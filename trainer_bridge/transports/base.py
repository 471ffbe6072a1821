"""The weight-transport contract, and the helpers every transport shares.

A transport moves a trainer's (HF name, tensor) pairs into the parameters of one or more
engines. "Engine" means anything with the `rollout_engine.Engine` RL methods: an in-process
`Engine`, or a `RolloutClient` for a server. Update methods return `(success, message)`;
`checked` turns a failure into `WeightSyncError`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Optional, TypeVar

import torch

__all__ = ["Answer", "WeightSyncError", "WeightTransport", "call_all", "checked", "pipeline_depth",
           "spawn", "start_call", "step_version", "waited", "with_last"]

T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update (its message says why)."""


class WeightTransport(ABC):
    """Moves named tensors from the trainer into engines; one implementation per path."""

    name: str = "abstract"

    def setup(self, engines: Sequence[Any]) -> None:
        """Prepare a channel to `engines` (e.g. join a process group). Called once, before the
        first `push`, with the same engines in the same order. Default: nothing to prepare."""
        return None

    @abstractmethod
    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: str) -> int:
        """Load `named_tensors` (HF names, each exactly the dtype and shape of the engine's
        parameter) into every engine and leave each one at weight version `version`.

        Returns the bytes moved to each engine (the tensors' bytes, plus alignment padding when
        packed in buckets; counted once however many engines received them). The caller must not modify the tensors until this returns and must not
        call `push` concurrently. Each engine call is atomic (validated before any parameter
        changes); a transport that splits the payload into several calls labels the earlier
        ones `step_version(version, i)`, so KV computed from half-updated weights is never
        reused. Raises `WeightSyncError` if an engine refuses an update; engines may then hold
        the buckets that were applied before the failure and must be synced again.
        """

    def close(self, engines: Sequence[Any]) -> None:
        """Release what `setup` made (process groups, temp files). Default: nothing."""
        return None


def step_version(version: str, index: int) -> str:
    """The weight version of call `index` of a push made in several calls; the final call
    carries `version` itself."""
    return f"{version}.partial{index}"


def with_last(items: Iterable[T]) -> Iterator[tuple[int, T, bool]]:
    """(index, item, is_last) for a lazy iterable, looking one item ahead."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    index = 0
    for nxt in it:
        yield index, current, False
        current, index = nxt, index + 1
    yield index, current, True


def checked(engine: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call `engine.<method>(...)`; a `(False, message)` answer raises WeightSyncError."""
    return _refused(engine, method, getattr(engine, method)(*args, **kwargs))


def _refused(engine: Any, method: str, result: Any) -> Any:
    if isinstance(result, tuple) and len(result) == 2 and result[0] is False:
        raise WeightSyncError(f"{method} failed on {type(engine).__name__}: {result[1]}")
    return result


def _sender(engine: Any) -> Optional[Callable[..., Any]]:
    """The engine's own ``send_call`` (defined by its class), or None."""
    return getattr(engine, "send_call", None) if callable(
        getattr(type(engine), "send_call", None)) else None


def pipeline_depth(engines: Sequence[Any], depth: int) -> int:
    """Calls a bucketed sync may keep outstanding: `depth` when every engine takes calls in
    the order sent (`start_call` sends through its ``send_call``), else 1 (the next call
    starts only once the previous one answered, so a thread per call cannot reorder them)."""
    return depth if all(_sender(e) is not None for e in engines) else 1


def start_call(engine: Any, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
    """`checked(engine, method, ...)` in a daemon thread, reaching the engine in call order.

    Calls started one after another on one engine must arrive in that order (a broadcast's
    receives are matched to rank 0's sends by order; a refit's last call must land last), which
    a thread per call does not promise. So an engine that can send a call without waiting for
    its answer (its class has ``send_call(method, ...)`` -> a function that waits for the
    answer, as `Engine` and `trainer_bridge.ray.RayEngine` do) is sent to here, in the
    caller's thread, and only the wait is left (an `Answer`: `call_all` waits for a lone one
    in its own thread, else in a thread each). Other engines, and wrappers that merely
    forward attributes (their own update methods must be the ones called), are called in the
    thread."""
    send = _sender(engine)
    if send is None:
        return spawn(checked, engine, method, *args, **kwargs)
    try:
        answer = send(method, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - delivered to the waiter, like a thread's
        failed: Future[Any] = Future()
        failed.set_exception(e)
        return failed
    return Answer(lambda: _refused(engine, method, answer()))


class Answer(Future):
    """The answer of a call already sent: a future nobody waits for until asked.

    A thread per call (to wait for its answer) costs ~0.1-0.2 ms of CPU a call, which a refit
    in small buckets pays on the cores the engine is copying with. So the wait runs either in
    the thread of whoever waits for this answer alone (`call_all` of one future, no timeout)
    or, once anything else needs it done (several engines, a timeout), in a thread of its own;
    whichever comes first, once."""

    def __init__(self, wait_for_it: Callable[[], Any]) -> None:
        super().__init__()
        self._wait_for_it: Optional[Callable[[], Any]] = wait_for_it
        self._claim = threading.Lock()

    def _claimed(self) -> Optional[Callable[[], Any]]:
        with self._claim:
            fn, self._wait_for_it = self._wait_for_it, None
            return fn

    def wait_here(self) -> None:
        """Wait in this thread (unless a thread of its own already waits)."""
        fn = self._claimed()
        if fn is not None:
            _settle(self, fn)

    def wait_in_thread(self) -> None:
        """Have a daemon thread wait (unless someone already does)."""
        fn = self._claimed()
        if fn is not None:
            threading.Thread(target=_settle, args=(self, fn), daemon=True,
                             name="answer").start()


def waited(futures: Sequence[Future[Any]]) -> Sequence[Future[Any]]:
    """`futures`, each `Answer` among them with a thread waiting for it: what
    `concurrent.futures.wait` needs of them."""
    for f in futures:
        if isinstance(f, Answer):
            f.wait_in_thread()
    return futures


def _settle(future: Future[T], fn: Callable[[], T]) -> None:
    """`future` completed with what `fn()` returns or raises."""
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - delivered to the waiter
        future.set_exception(e)


def spawn(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run `fn` in a daemon thread (a call blocked on a dead peer must not block exit)."""
    future: Future[T] = Future()
    threading.Thread(target=_settle, args=(future, lambda: fn(*args, **kwargs)), daemon=True,
                     name=getattr(fn, "__name__", "call")).start()
    return future


def call_all(futures: Sequence[Future[Any]], timeout: Optional[float] = None) -> list[Any]:
    """Wait for `futures`; raise the first failure at once (without waiting for the rest),
    TimeoutError if they are not done within `timeout` seconds."""
    if len(futures) == 1 and timeout is None and isinstance(futures[0], Answer):
        futures[0].wait_here()
    done, pending = wait(waited(futures), timeout=timeout, return_when=FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    if pending:
        raise TimeoutError(f"{len(pending)} engine call(s) did not finish within {timeout}s")
    return [f.result() for f in futures]
