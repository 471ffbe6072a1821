"""Generation for the HTTP routes: submit through the ``TokenizerManager``, wait or stream,
abort whatever the client stops waiting for, and count what finishes.

    route -> GenerationService.submit (validate and tokenize in a worker thread, then send)
          -> collect (non-streaming; a watcher aborts on client disconnect)
           | stream  (merged chunks of every request of the call; closing it aborts the rest)
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from starlette.requests import Request

from rollout_engine.entrypoints.metrics import Metrics
from rollout_engine.tokenizer_manager import RequestState

if TYPE_CHECKING:
    from rollout_engine.entrypoints.engine import Engine

T = TypeVar("T")
TOKENIZE_THREADS = 4
TEMPLATE_THREADS = 2


class GenerationService:
    """Request bookkeeping shared by ``/generate`` and the OpenAI routes."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.tm = engine.tm
        self.metrics = metrics
        # tokenizing a long prompt must not stall the event loop (every other request's
        # stream); its own pool, so slow control calls cannot starve it
        self.executor = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="rollout-tokenize")
        # chat templates are programs (bounded, but up to max_template_render_s each): a pool
        # of their own, so renders never hold the threads plain tokenization waits for
        self.template_executor = ThreadPoolExecutor(TEMPLATE_THREADS,
                                                    thread_name_prefix="rollout-chat-template")

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-bound request preparation in the tokenizer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def offload_template(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a chat-template render in the template threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.template_executor,
                                          functools.partial(fn, *args, **kwargs))

    # -- submitting ----------------------------------------------------------------------------
    async def submit(self, prompt: Any = None, input_ids: Any = None,
                     sampling_params: Any = None, return_logprob: Any = False,
                     top_logprobs_num: Any = 0, logprob_start_len: Any = -1,
                     stream: bool = False, rid: Any = None, extra_key: Any = None,
                     cache_salt: Any = None, **selected: Any
                     ) -> tuple[list[RequestState], bool]:
        """Validate (ValueError -> 400) and send; returns the states and whether the caller
        asked for a single answer (not a batch, n == 1). A full engine (max_queued_requests)
        is refused before any tokenizing (503)."""
        self.tm.check_can_generate()
        self.tm.check_capacity()
        reqs, single = await self.offload(
            self.tm.build_requests, prompt, input_ids, sampling_params, return_logprob,
            top_logprobs_num, -1 if logprob_start_len is None else logprob_start_len, stream,
            rid, extra_key, cache_salt=cache_salt, **selected)
        return self.tm.submit(reqs), single

    def abort_unfinished(self, states: list[RequestState]) -> int:
        n = 0
        for st in states:
            if not st.done and self.tm.dead is None:
                self.tm.abort(rid=st.req.rid)
                n += 1
        return n

    # -- waiting -------------------------------------------------------------------------------
    async def collect(self, states: list[RequestState],
                      request: Optional[Request] = None) -> list[dict[str, Any]]:
        """Wait for every request. A client that disconnects first aborts them (the scheduler
        frees their KV); their aborted results are then returned to nobody."""
        watcher = (asyncio.create_task(self._watch_disconnect(request, states))
                   if request is not None else None)
        try:
            results = await asyncio.gather(*(self.tm.async_wait(st) for st in states))
        finally:
            if watcher is not None:
                watcher.cancel()
            self.abort_unfinished(states)
        for r in results:
            self.metrics.observe_finished(r["meta_info"])
        return list(results)

    async def _watch_disconnect(self, request: Request, states: list[RequestState]) -> None:
        # The body has been read, so the next ASGI message is the disconnect (or the end of
        # the response, by which time this task is cancelled).
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if self.abort_unfinished(states):
                    self.metrics.observe_disconnect()
                return

    async def stream(self, states: list[RequestState], cumulative: bool = False,
                     with_text: bool = False) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """``(index, chunk)`` for every request of a call, as they arrive: deltas, or SGLang's
        cumulative chunks (``cumulative``); ``with_text`` fills logprob entries' text slot.
        Closing the iterator early (client disconnect) aborts the unfinished ones."""
        token_text = self.tm.token_text if with_text else None
        queue: asyncio.Queue[tuple[int, Optional[dict[str, Any]], Optional[BaseException]]] = (
            asyncio.Queue())

        async def pump(i: int, st: RequestState) -> None:
            try:
                async for chunk in self.tm.async_iter_chunks(st, cumulative, token_text):
                    queue.put_nowait((i, chunk, None))
                queue.put_nowait((i, None, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(states)]
        first_token = [True] * len(states)
        remaining = len(states)
        try:
            while remaining:
                i, chunk, err = await queue.get()
                if err is not None:
                    raise err
                if chunk is None:
                    remaining -= 1
                    continue
                if first_token[i] and chunk["output_ids"]:
                    first_token[i] = False
                    self.metrics.observe_first_token(time.time() - states[i].created)
                if chunk["meta_info"]["finish_reason"] is not None:
                    self.metrics.observe_finished(chunk["meta_info"])
                yield i, chunk
        finally:
            for t in tasks:
                t.cancel()
            if self.abort_unfinished(states):
                self.metrics.observe_disconnect()
