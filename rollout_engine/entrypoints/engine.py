"""The in-process Python ``Engine`` (SGLang's method names); the scheduler runs in a child
process (or a thread with ``scheduler_mode="thread"``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, Optional, Union

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import ControlResult
from rollout_engine.tokenizer_manager import TokenizerManager

Output = Union[dict[str, Any], list[dict[str, Any]]]


class Engine:
    """``Engine(model_path=..., **flags)``; the flags are ``EngineConfig`` fields."""

    def __init__(self, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(**kwargs)
        self.tm = TokenizerManager(self.config)
        self.tokenizer = self.tm.tokenizer

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: Any = False, top_logprobs_num: Any = 0,
                 logprob_start_len: Any = -1, stream: bool = False, rid: Any = None,
                 extra_key: Optional[str] = None) -> Union[Output, Iterator[dict[str, Any]]]:
        """Generate for one prompt (dict) or a batch / ``n > 1`` (list of dicts).

        With ``stream=True`` returns an iterator of chunks whose ``text`` and ``output_ids`` are
        deltas; the last chunk has ``meta_info.finish_reason`` set.
        """
        reqs, single = self.tm.build_requests(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
            -1 if logprob_start_len is None else logprob_start_len, stream, rid, extra_key)
        if stream and len(reqs) != 1:
            raise ValueError("stream: streaming takes one prompt with n = 1")
        states = self.tm.submit(reqs)
        if stream:
            return self.tm.iter_chunks(states[0])
        results = [self.tm.wait(st) for st in states]
        return results[0] if single else results

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: Any = False,
                             top_logprobs_num: Any = 0, logprob_start_len: Any = -1,
                             stream: bool = False, rid: Any = None,
                             extra_key: Optional[str] = None
                             ) -> Union[Output, AsyncIterator[dict[str, Any]]]:
        reqs, single = self.tm.build_requests(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
            -1 if logprob_start_len is None else logprob_start_len, stream, rid, extra_key)
        if stream and len(reqs) != 1:
            raise ValueError("stream: streaming takes one prompt with n = 1")
        states = self.tm.submit(reqs)
        if stream:
            return self.tm.async_iter_chunks(states[0])
        try:
            results = await asyncio.gather(*(self.tm.async_wait(st) for st in states))
        except asyncio.CancelledError:
            for st in states:
                self.tm.abort(rid=st.req.rid)
            raise
        return results[0] if single else list(results)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.tm.abort(rid=rid or None, abort_all=abort_all)

    # -- control ---------------------------------------------------------------------------------
    def _call(self, method: str, **kwargs: Any) -> ControlResult:
        return self.tm.call(method, **kwargs)

    def flush_cache(self) -> bool:
        return self._call("flush_cache").success

    def check_integrity(self) -> dict[str, Any]:
        """Prove the KV invariant (free + cached + owned == total); raises if broken."""
        r = self._call("check_integrity")
        if not r.success:
            raise AssertionError(r.message)
        return r.result

    def get_model_info(self) -> dict[str, Any]:
        info = self.get_server_info()
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.config.model_path,
            "is_generation": True,
            "weight_version": info["weight_version"],
            "architectures": self.tm.server_info.get("architectures"),
            "context_length": self.tm.context_len,
            "vocab_size": self.tm.vocab_size,
        }

    def get_server_info(self) -> dict[str, Any]:
        r = self._call("get_server_info")
        if not r.success:
            raise RuntimeError(r.message)
        return {**self.config.to_dict(), **r.result}

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.tm.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        tm = getattr(self, "tm", None)
        if tm is not None and tm.dead is None:
            try:
                tm.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
