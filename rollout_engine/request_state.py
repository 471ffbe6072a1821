"""One request's outputs on the frontend, and the stream a caller iterates over.

    receiver thread --(delta chunks, final | error)--> RequestState --(wait | ChunkStream)--> caller

The receiver queues one *delta* chunk per output (the new text and ids, and the new tokens'
logprobs). ``ChunkStream`` hands them out in one of SGLang's two streaming shapes:

    cumulative (SGLang's default)   each chunk: all text, output_ids and output logprobs so far
                                    (chunks that piled up are merged: only the latest is shown)
    incremental                     each chunk: only what is new (SGLang's
                                    --incremental-streaming-output; OpenAI deltas use it too)

Either way a chunk's meta_info carries the prompt logprobs (``input_*``) once they are known,
as SGLang's tokenizer manager does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.detokenizer import IncrementalDetokenizer
from rollout_engine.protocol.messages import GenerateReq

_TOKEN_LOGPROB_KEYS = ("output_token_logprobs", "input_token_logprobs")
_TOP_LOGPROB_KEYS = ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
                     "input_token_ids_logprobs")
_OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs",   # grow with each chunk
                "output_token_ids_logprobs")
_INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs",      # arrive once
               "input_token_ids_logprobs")


def add_token_text(out: dict[str, Any], token_text: Callable[[int], str]) -> dict[str, Any]:
    """``return_text_in_logprobs``: fill the third slot of each ``[logprob, id, text]`` entry
    (SGLang's tuple shape; the slot is null otherwise). Returns a new dict."""
    meta = dict(out["meta_info"])
    for key in _TOKEN_LOGPROB_KEYS:
        if meta.get(key) is not None:
            meta[key] = [[lp, tid, token_text(tid)] for lp, tid, _ in meta[key]]
    for key in _TOP_LOGPROB_KEYS:
        if meta.get(key) is not None:
            meta[key] = [None if top is None else [[lp, tid, token_text(tid)]
                                                    for lp, tid, _ in top]
                         for top in meta[key]]
    return {**out, "meta_info": meta}


def kept_arrays(rows: list[list[int]]) -> dict[str, list[int]]:
    """Per-token id sets as ``top_p_token_ids`` (all of them, in token order) and
    ``top_p_token_offsets`` (``len(rows) + 1`` offsets from 0: token k's ids are
    ``ids[offsets[k]:offsets[k + 1]]``)."""
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    return {"top_p_token_ids": [t for row in rows for t in row], "top_p_token_offsets": offsets}


def kept_rows(meta: dict[str, Any]) -> list[list[int]]:
    """``kept_arrays`` back to per-token sets."""
    ids, offsets = meta["top_p_token_ids"], meta["top_p_token_offsets"]
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


class SchedulerDeadError(RuntimeError):
    """The scheduler is gone; nothing can be served (HTTP 503)."""


@dataclass
class RequestState:
    """Outputs of one request as they arrive; waited on by threads or asyncio tasks."""

    req: GenerateReq
    detok: IncrementalDetokenizer
    created: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)   # stream chunks not yet taken
    final: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()
            waiters = list(self.waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # that loop is closed; its caller is gone

    def take_pending(self) -> list[dict[str, Any]]:
        with self.cond:
            chunks, self.pending = self.pending, []
        return chunks

    async def changed(self) -> None:
        """Return once a chunk is pending or the request is done."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self.cond:
            if self.pending or self.done:
                return
            self.waiters.append((loop, event))
        try:
            await event.wait()
        finally:
            with self.cond:
                self.waiters.remove((loop, event))


class ChunkStream:
    """The chunks of one streaming request, for ``for`` and ``async for``.

    ``cumulative``: SGLang's default shape (see the module docstring); False gives deltas.
    ``token_text``: fills the text slot of logprob entries (``return_text_in_logprobs``).

    Closing the stream before the request finishes aborts the request, so the scheduler stops
    decoding it and frees its KV: ``close()`` / ``aclose()``, leaving a ``with`` block, or
    dropping the stream (``break`` out of ``for chunk in engine.generate(..., stream=True)``,
    garbage collection). A dropped stream's finalizer only hands its rid to ``on_drop``, which
    must merely record it (a finalizer can run inside any allocation, even while this thread
    holds a lock mid-send); the frontend sends those aborts from ordinary code. A dead
    scheduler raises ``SchedulerDeadError`` after the last chunk.
    """

    def __init__(self, st: RequestState, abort: Callable[[str], None], *,
                 cumulative: bool = False,
                 token_text: Optional[Callable[[int], str]] = None,
                 on_drop: Optional[Callable[[str], None]] = None) -> None:
        self.st = st
        self._abort = abort
        self._on_drop = on_drop
        self._buf: deque[dict[str, Any]] = deque()
        self.closed = False
        self.cumulative = cumulative
        self._token_text = token_text
        self._text = ""                              # what the chunks so far carried
        self._ids: list[int] = []
        self._grown: dict[str, list[Any]] = {}       # output logprob lists so far
        self._kept: list[list[int]] = []             # kept nuclei so far, per token
        self._inputs: dict[str, Any] = {}            # prompt logprobs, once known

    def _shape(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Delta chunks from the receiver -> the chunks this stream hands out."""
        out = []
        for chunk in deltas:
            if self._token_text is not None:
                chunk = add_token_text(chunk, self._token_text)
            meta = chunk["meta_info"]
            self._inputs.update({k: meta[k] for k in _INPUT_KEYS if k in meta})
            self._text += chunk["text"]
            self._ids += chunk["output_ids"]
            for key in _OUTPUT_KEYS:
                if key in meta:
                    self._grown.setdefault(key, []).extend(meta[key])
            if "top_p_token_offsets" in meta:
                self._kept += kept_rows(meta)
            if self.cumulative:
                meta = {**meta, **{k: list(v) for k, v in self._grown.items()}}
                if "top_p_token_offsets" in meta:
                    meta.update(kept_arrays(self._kept))
                chunk = {"text": self._text, "output_ids": list(self._ids), "meta_info": meta}
            out.append({**chunk, "meta_info": {**chunk["meta_info"], **self._inputs}})
        # a cumulative chunk holds everything before it: show only the latest of a pile-up
        return out[-1:] if self.cumulative else out

    def _next(self) -> Optional[dict[str, Any]]:
        """The next chunk; None when none is there yet. Raises at the end of the stream."""
        if not self._buf and not self.closed:
            self._buf.extend(self._shape(self.st.take_pending()))
        if self._buf:
            return self._buf.popleft()
        if self.closed:
            raise StopIteration
        if self.st.error is not None:
            self.closed = True
            raise SchedulerDeadError(self.st.error)
        if self.st.done:
            self.closed = True
            raise StopIteration
        return None

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> dict[str, Any]:
        st = self.st
        while True:
            chunk = self._next()
            if chunk is not None:
                return chunk
            with st.cond:
                st.cond.wait_for(lambda: bool(st.pending) or st.done)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            try:
                chunk = self._next()
            except StopIteration:
                raise StopAsyncIteration from None
            if chunk is not None:
                return chunk
            await self.st.changed()

    def close(self) -> None:
        """Stop reading; abort the request unless it already finished."""
        if self.closed:
            return
        self.closed = True
        self._buf.clear()
        if not self.st.done:
            self._abort(self.st.req.rid)

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # record only: no send, no lock (see the class docstring)
        if getattr(self, "closed", True) or self._on_drop is None or self.st.done:
            return
        self.closed = True
        self._on_drop(self.st.req.rid)
