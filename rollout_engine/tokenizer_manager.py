"""The frontend half of the engine: tokenize and validate, send typed requests to the
scheduler, receive token outputs, detokenize, and hand results to sync or async callers.
Control calls go through its `ControlClient` (control_client.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from transformers import AutoTokenizer

from rollout_engine.config import EngineConfig
from rollout_engine.control_client import ControlClient
from rollout_engine.detokenizer import DecodeTraits, IncrementalDetokenizer
from rollout_engine.protocol.messages import (
    AbortReq,
    BatchOutput,
    ControlResult,
    GenerateReq,
    ReqOutput,
    SchedulerDied,
    SchedulerReady,
)
from rollout_engine.request_builder import (
    RequestBuilder,
    RequestLimits,
    grammar_check_for,
    routed_experts_refusal,
)
from rollout_engine.request_state import ChunkStream, RequestState, SchedulerDeadError, kept_arrays

if TYPE_CHECKING:
    from rollout_engine.runtime.hosts import SchedulerHost

logger = logging.getLogger(__name__)

__all__ = ["EngineAsleepError", "EngineBusyError", "EngineOverloadedError", "RequestState",
           "SchedulerDeadError", "TokenizerManager"]


class EngineAsleepError(RuntimeError):
    """Memory is released or weights are stale: generation is refused (HTTP 503)."""


class EngineBusyError(RuntimeError):
    """A control call that needs an idle engine arrived while requests run (HTTP 409)."""


class EngineOverloadedError(RuntimeError):
    """``max_queued_requests`` requests are already in flight; retry later (HTTP 503)."""


RECEIVE_TICK_S = 0.2   # the receiver's longest wait: how late a dropped stream's abort is sent


class TokenizerManager:
    """The frontend over a started scheduler host (``runtime.start.start_scheduler``): waits
    for its SchedulerReady, then talks to it through ``host.chan``; ``shutdown`` stops it."""

    def __init__(self, config: EngineConfig, host: SchedulerHost) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
        self.decode_traits = DecodeTraits.of(self.tokenizer)
        # Each engine draws its own seed unless given one: replicas and restarts must not
        # all sample the same "random" rollouts. Reported by get_server_info.
        self.random_seed: int = (config.random_seed if config.random_seed is not None
                                 else secrets.randbits(63))
        self.rng = random.Random(self.random_seed)
        self.states: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}   # token_text cache
        self.lock = threading.Lock()
        self.dead: Optional[str] = None
        # Finalizers only record (deque.append takes no lock): rids of streams dropped
        # unfinished, and whether the Engine was collected without a shutdown. The receiver
        # thread acts on both from ordinary code.
        self.dropped: deque[str] = deque()
        self.orphaned = False
        self.host: SchedulerHost = host
        # control calls in flight, and the sleep / stale state their answers reported
        self.control = ControlClient(host.chan.send, config.watchdog_timeout)
        ready = self._wait_ready(timeout=config.watchdog_timeout)
        self.server_info: dict[str, Any] = ready.info
        self.vocab_size: int = ready.info["vocab_size"]
        self.context_len: int = ready.info["context_length"]
        pool = ready.info["max_total_num_tokens"] // config.page_size * config.page_size
        self.control.lora_adapters = dict(ready.info.get("loaded_adapters") or {})
        self.builder = RequestBuilder(self.tokenizer, self.vocab_size, self.context_len,
                                      self.rng, RequestLimits.of(config), pool_tokens=pool,
                                      grammar_check=grammar_check_for(config),
                                      routed_experts_refusal=routed_experts_refusal(
                                          config.enable_return_routed_experts,
                                          ready.info.get("routed_experts_bytes_per_token", 0)),
                                      lora_adapters=(lambda: self.control.lora_adapters)
                                      if config.enable_lora else None)
        self.receiver = threading.Thread(target=self._receive_loop, name="rollout-receiver",
                                         daemon=True)
        self.receiver.start()

    def _wait_ready(self, timeout: float) -> SchedulerReady:
        deadline = time.time() + timeout
        while time.time() < deadline:
            msg = self.host.chan.recv(timeout=0.2)
            if isinstance(msg, SchedulerReady):
                return msg
            if isinstance(msg, SchedulerDied):
                self.host.stop(timeout=5)
                raise RuntimeError(msg.message)
            if msg is None and not self.host.is_alive():
                raise RuntimeError("the scheduler exited before it was ready")
        self.host.stop(timeout=5)
        raise RuntimeError(f"the scheduler was not ready within {timeout:.0f} s")

    # -- receiving -----------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            if self.orphaned:
                self.shutdown()
                return
            self.send_dropped_aborts()
            try:
                msg = self.host.chan.recv(timeout=RECEIVE_TICK_S)
            except (EOFError, OSError):
                if self.dead is not None:
                    return  # shut down on purpose
                msg = SchedulerDied("the scheduler process closed its pipe (it died)")
            if msg is None:
                if not self.host.is_alive() and self.dead is None:
                    msg = SchedulerDied("the scheduler process exited unexpectedly")
                else:
                    continue
            if isinstance(msg, BatchOutput):
                for out in msg.outputs:
                    self._on_output(out)
            elif isinstance(msg, ControlResult):
                self.control.on_result(msg)
            elif isinstance(msg, SchedulerDied):
                self._on_death(msg.message)
                return

    def _on_death(self, message: str) -> None:
        logger.error("scheduler died: %s", message)
        self.dead = message
        with self.lock:
            states = list(self.states.values())
        for st in states:
            st.error = f"the scheduler died: {message.splitlines()[0]}"
            st.notify()
        self.control.fail_all("the scheduler died")

    def _on_output(self, out: ReqOutput) -> None:
        with self.lock:
            st = self.states.get(out.rid)
        if st is None:
            return
        finished = out.finished_reason is not None
        st.output_ids.extend(out.token_ids)
        matched = (out.finished_reason or {}).get("matched")
        delta = st.detok.push(out.token_ids, finished,
                              stop_token=isinstance(matched, int) and not isinstance(matched, bool))
        if st.req.stream:
            chunk = self._chunk(st, out, delta)
            with st.cond:   # a reader swaps the list under this lock
                st.pending.append(chunk)
        if finished:
            st.final = self._final(st, out)
            with self.lock:
                self.states.pop(out.rid, None)
        st.notify()

    def _meta(self, st: RequestState, out: ReqOutput) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": st.req.rid,
            "finish_reason": out.finished_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version,
            "e2e_latency": time.time() - st.created,
        }
        if out.weight_spans is not None:   # the final output: vLLM's WeightVersionSpan list
            meta["weight_versions"] = [span.to_dict() for span in out.weight_spans]
        if out.spec is not None:
            meta.update(out.spec.meta_info(out.completion_tokens))
        if out.top_p_kept is not None:   # CSR over this output's tokens, as slime reads it
            meta.update(kept_arrays(out.top_p_kept))
        if out.routed_experts is not None:   # the final output of a request that asked
            meta["routed_experts"] = out.routed_experts.base64()
        if st.req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(out.output_logprobs, out.token_ids)]
            if st.req.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [[lp, tid, None] for lp, tid in top] for top in out.output_top_logprobs]
            if st.req.token_ids_logprob is not None:
                meta["output_token_ids_logprobs"] = [
                    [[lp, tid, None] for lp, tid in chosen]
                    for chosen in out.output_token_ids_logprobs]
            if out.input_logprobs is not None:
                start = max(st.req.logprob_start_len, 0)
                ids = st.req.input_ids[start:]
                meta["input_token_logprobs"] = [
                    [lp, tid, None] for lp, tid in zip(out.input_logprobs, ids)]
                if st.req.top_logprobs_num and out.input_top_logprobs is not None:
                    meta["input_top_logprobs"] = [
                        None if top is None else [[lp, tid, None] for lp, tid in top]
                        for top in out.input_top_logprobs]
                if out.input_token_ids_logprobs is not None:
                    meta["input_token_ids_logprobs"] = [
                        None if chosen is None else [[lp, tid, None] for lp, tid in chosen]
                        for chosen in out.input_token_ids_logprobs]
        return meta

    def _chunk(self, st: RequestState, out: ReqOutput, delta: str) -> dict[str, Any]:
        """A delta chunk: this output's new text, ids and logprobs (the ChunkStream a caller
        reads makes it cumulative, SGLang's default, unless asked for increments)."""
        return {"text": delta, "output_ids": list(out.token_ids), "meta_info": self._meta(st, out)}

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens kept (``return_text_in_logprobs``)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _final(self, st: RequestState, out: ReqOutput) -> dict[str, Any]:
        if st.req.stream:
            # stream outputs carried deltas; the final dict reports the whole sequence
            out = ReqOutput(**{**out.__dict__, "token_ids": st.output_ids})
        return {"text": st.detok.full_text(), "output_ids": list(st.output_ids),
                "meta_info": self._meta(st, out)}

    # -- requests ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.dead is not None:
            raise SchedulerDeadError(f"the scheduler died: {self.dead.splitlines()[0]}")

    def check_can_generate(self) -> None:
        self.check_alive()
        control = self.control
        if control.released & {"weights", "kv_cache"}:
            raise EngineAsleepError(
                f"the engine is asleep (released: {sorted(control.released)}); "
                "call resume_memory_occupation (vLLM: /wake_up) first")
        if control.weights_stale:
            raise EngineAsleepError(control.stale_reason or
                                    "weights were released without a CPU backup and are stale; "
                                    "refit (update_weights_*) before generating")
    def build_requests(self, *args: Any, **kwargs: Any) -> tuple[list[GenerateReq], bool]:
        """Validate a generate call and expand it into scheduler requests (RequestBuilder)."""
        return self.builder.build(*args, **kwargs)

    def check_capacity(self, num_new: int = 1) -> None:
        """Raise EngineOverloadedError when ``num_new`` more requests would exceed
        ``max_queued_requests`` (requests in flight: submitted and not finished)."""
        limit = self.config.max_queued_requests
        if limit is not None and len(self.states) + num_new > limit:
            raise EngineOverloadedError(
                f"the engine is full: {len(self.states)} requests in flight, this call adds "
                f"{num_new}, max_queued_requests={limit}; retry when some finish")

    def submit(self, reqs: list[GenerateReq]) -> list[RequestState]:
        self.check_can_generate()
        states = []
        with self.lock:
            self.check_capacity(len(reqs))
            seen: set[str] = set()
            for r in reqs:
                if r.rid in self.states or r.rid in seen:
                    raise ValueError(f"rid: {r.rid!r} is already in flight")
                seen.add(r.rid)
            for r in reqs:
                sp = r.sampling_params
                st = RequestState(r, IncrementalDetokenizer(
                    self.tokenizer, sp.skip_special_tokens, sp.stop, sp.no_stop_trim,
                    traits=self.decode_traits, min_new_tokens=sp.min_new_tokens))
                self.states[r.rid] = st
                states.append(st)
        self.host.chan.send_many(reqs)
        return states

    def abort(self, rid: Optional[str] = None, abort_all: bool = False, prefix: bool = False,
              message: Optional[str] = None,
              finished_reason: Optional[dict[str, Any]] = None) -> None:
        """Abort ``rid`` (and its group), every rid starting with ``rid`` (``prefix``), or every
        request; ``message`` / ``finished_reason`` are what the aborted requests end with."""
        if self.dead is None:
            msg = AbortReq(rid=rid, abort_all=abort_all, prefix=prefix,
                           finished_reason=finished_reason)
            if message is not None:
                msg.message = message
            self.host.chan.send(msg)

    def send_dropped_aborts(self) -> None:
        """Abort the requests whose streams were dropped unfinished (recorded by finalizers)."""
        while self.dropped:
            try:
                rid = self.dropped.popleft()
            except IndexError:
                return
            try:
                self.abort(rid=rid)
            except OSError:
                return   # the scheduler is gone: nothing to stop

    # -- waiting -------------------------------------------------------------------------------
    def wait(self, st: RequestState, timeout: Optional[float] = None) -> dict[str, Any]:
        with st.cond:
            if not st.cond.wait_for(lambda: st.done, timeout=timeout):
                raise TimeoutError(f"request {st.req.rid} did not finish in {timeout} s")
        if st.error is not None:
            raise SchedulerDeadError(st.error)
        assert st.final is not None
        return st.final

    def iter_chunks(self, st: RequestState, cumulative: bool = False,
                    token_text: Optional[Callable[[int], str]] = None) -> ChunkStream:
        """The request's chunks (``for`` or ``async for``): deltas, or SGLang's cumulative
        chunks with ``cumulative``; ``token_text`` fills logprob entries' text slot. Closing
        the stream early, or dropping it, aborts the request."""
        return ChunkStream(st, lambda rid: self.abort(rid=rid), cumulative=cumulative,
                           token_text=token_text, on_drop=self.dropped.append)

    async def async_wait_change(self, st: RequestState) -> None:
        await st.changed()

    async def async_wait(self, st: RequestState) -> dict[str, Any]:
        while not st.done:
            await self.async_wait_change(st)
        if st.error is not None:
            raise SchedulerDeadError(st.error)
        assert st.final is not None
        return st.final

    def async_iter_chunks(self, st: RequestState, cumulative: bool = False,
                          token_text: Optional[Callable[[int], str]] = None) -> ChunkStream:
        return self.iter_chunks(st, cumulative, token_text)

    # -- control -------------------------------------------------------------------------------
    def call(self, method: str, timeout: Optional[float] = None, **kwargs: Any) -> ControlResult:
        """Run a scheduler control call and wait for its result (at most ``timeout`` s, default
        ``watchdog_timeout``). The call carries that deadline: if the scheduler has not started
        it by then it is cancelled; if it had, it runs to the end, and its late answer is
        logged and counted in ``control.stats``."""
        return self.start_call(method, timeout, **kwargs)()

    def start_call(self, method: str, timeout: Optional[float] = None, **kwargs: Any
                   ) -> Callable[[], ControlResult]:
        """`call`, split: send the call now (calls sent one after another reach the scheduler
        in that order) and return a function that waits for its result (`ControlClient`)."""
        self.check_alive()
        return self.control.start(method, timeout, **kwargs)

    async def async_call(self, method: str, timeout: Optional[float] = None,
                         **kwargs: Any) -> ControlResult:
        return await asyncio.to_thread(self.call, method, timeout, **kwargs)

    def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "the engine was shut down"
        self.host.stop(timeout=10)
        with self.lock:
            states = list(self.states.values())
        for st in states:
            if not st.done:
                st.error = "the engine was shut down"
                st.notify()
