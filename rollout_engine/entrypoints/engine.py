"""The in-process Python ``Engine`` (SGLang's method names): it starts the scheduler host
(``runtime.start_scheduler``: a child process, or a thread with ``scheduler_mode="thread"``)
and hands it to the frontend (``TokenizerManager``)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Optional, Union

from rollout_engine.compat.fields import GENERATE_REQUEST, Treatment
from rollout_engine.compat.server_args import (
    IGNORED_ARGS_FIELD,
    SGLANG_VERSIONS,
    server_args_view,
)
from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints.lora_api import LoraMethods
from rollout_engine.protocol.messages import ControlResult
from rollout_engine.protocol.shm_lease import ShmLease
from rollout_engine.protocol.tensor_payload import lend_named_tensors
from rollout_engine.request_builder import bootstrap_fields
from rollout_engine.request_state import add_token_text
from rollout_engine.runtime.start import start_scheduler
from rollout_engine.tokenizer_manager import (
    EngineAsleepError,
    EngineBusyError,
    TokenizerManager,
)

Output = Union[dict[str, Any], list[dict[str, Any]]]


def rollout_engine_version() -> str:
    try:
        return importlib.metadata.version("rollout-engine")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree
        return "0+unknown"


SENDABLE_CALLS = ("update_weights_from_disk", "update_weights_from_tensor",
                  "update_weights_from_distributed")
"""The calls `Engine.send_call` sends without waiting for their answers."""


class Engine(LoraMethods):
    """``Engine(model_path=..., **flags)``; the flags are ``EngineConfig`` fields or the names
    of SGLang's ``ServerArgs``, as ``sgl.Engine(**server_args)`` takes them (``tp_size=2``,
    ``enable_memory_saver=True``, ``log_level="error"``, ...; ``compat/server_args.py``).
    The LoRA calls (``load_lora_adapter``, ...) are ``LoraMethods``'."""

    def __init__(self, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(**kwargs)
        host = start_scheduler(self.config)
        try:
            self.tm = TokenizerManager(self.config, host)
        except BaseException:
            host.stop(timeout=5)   # no frontend (tokenizer, readiness): stopping twice is harmless
            raise
        self.tokenizer = self.tm.tokenizer
        self._sending = threading.local()   # send_call's collector of sent calls

    # -- generation ------------------------------------------------------------------------------
    def _submit(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any,
                top_logprobs_num: Any, logprob_start_len: Any, stream: bool, rid: Any,
                extra_key: Any, cache_salt: Any = None,
                sglang_kwargs: Optional[dict[str, Any]] = None,
                **selected: Any) -> tuple[list[Any], bool]:
        _check_sglang_kwargs(sglang_kwargs or {})
        reqs, single = self.tm.build_requests(
            prompt, input_ids, sampling_params, return_logprob,
            0 if top_logprobs_num is None else top_logprobs_num,
            -1 if logprob_start_len is None else logprob_start_len, stream, rid, extra_key,
            cache_salt=cache_salt, **selected)
        if stream and len(reqs) != 1:
            raise ValueError("stream: streaming takes one prompt with n = 1")
        return self.tm.submit(reqs), single

    def _stream(self, st: Any, with_text: bool) -> Any:
        return self.tm.iter_chunks(st, cumulative=not self.config.incremental_streaming_output,
                                   token_text=self.tm.token_text if with_text else None)

    def _finish(self, results: list[dict[str, Any]], single: bool, with_text: bool) -> Output:
        if with_text:
            results = [add_token_text(r, self.tm.token_text) for r in results]
        return results[0] if single else results

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: Any = False, top_logprobs_num: Any = 0,
                 logprob_start_len: Any = -1, stream: bool = False, rid: Any = None,
                 extra_key: Any = None, *, return_text_in_logprobs: bool = False,
                 cache_salt: Any = None, token_ids_logprob: Any = None,
                 token_ids_logprob_positions: Any = None, return_routed_experts: Any = False,
                 routed_experts_start_len: Any = 0, lora_path: Any = None,
                 bootstrap_host: Any = None, bootstrap_port: Any = None,
                 bootstrap_room: Any = None, **sglang_kwargs: Any
                 ) -> Union[Output, Iterator[dict[str, Any]]]:
        """Generate for one prompt (dict) or a batch / ``n > 1`` (list of dicts).

        Takes SGLang's ``Engine.generate`` keyword arguments (the names of its
        ``GenerateReqInput``; pass them by keyword): ``image_data``, ``lora_id``,
        ``return_hidden_states``, ``custom_logit_processor``,
        ``bootstrap_host``, ``data_parallel_rank``, ... null or SGLang's default is accepted,
        another value of a feature this engine lacks is a ValueError naming it
        (``rollout_engine/compat/fields.py`` lists every field); a name SGLang does not know
        is a TypeError.

        With ``stream=True`` returns an iterator of chunks; as SGLang streams, each carries the
        whole ``text``, ``output_ids`` and ``meta_info.output_token_logprobs`` so far, and the
        last has ``meta_info.finish_reason`` set. With the engine flag
        ``incremental_streaming_output=True`` each chunk carries only what is new.

        ``return_routed_experts`` (an engine started with ``enable_return_routed_experts`` on a
        mixture-of-experts model): the final output's ``meta_info["routed_experts"]`` holds the
        experts of every token fed to the model from ``routed_experts_start_len`` on (docs/API.md).

        ``lora_path``: a loaded LoRA adapter's name (one per prompt for a batch; None: the
        base model), as SGLang names the field; ValueError for one not loaded.

        ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``: on an engine started with
        ``disaggregation_mode`` prefill or decode, the pair's room (docs/API.md).
        """
        states, single = self._submit(prompt, sampling_params, input_ids, return_logprob,
                                      top_logprobs_num, logprob_start_len, stream, rid, extra_key,
                                      cache_salt, sglang_kwargs,
                                      token_ids_logprob=token_ids_logprob,
                                      token_ids_logprob_positions=token_ids_logprob_positions,
                                      return_routed_experts=return_routed_experts,
                                      routed_experts_start_len=routed_experts_start_len,
                                      lora_path=lora_path, bootstrap=bootstrap_fields({
                                          "bootstrap_host": bootstrap_host,
                                          "bootstrap_port": bootstrap_port,
                                          "bootstrap_room": bootstrap_room}))
        if stream:
            return self._stream(states[0], return_text_in_logprobs)
        return self._finish([self.tm.wait(st) for st in states], single, return_text_in_logprobs)

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: Any = False,
                             top_logprobs_num: Any = 0, logprob_start_len: Any = -1,
                             stream: bool = False, rid: Any = None, extra_key: Any = None, *,
                             return_text_in_logprobs: bool = False, cache_salt: Any = None,
                             token_ids_logprob: Any = None,
                             token_ids_logprob_positions: Any = None,
                             return_routed_experts: Any = False,
                             routed_experts_start_len: Any = 0, lora_path: Any = None,
                             bootstrap_host: Any = None, bootstrap_port: Any = None,
                             bootstrap_room: Any = None, **sglang_kwargs: Any
                             ) -> Union[Output, AsyncIterator[dict[str, Any]]]:
        """``generate`` for asyncio: the same arguments; an async iterator when streaming."""
        states, single = self._submit(prompt, sampling_params, input_ids, return_logprob,
                                      top_logprobs_num, logprob_start_len, stream, rid, extra_key,
                                      cache_salt, sglang_kwargs,
                                      token_ids_logprob=token_ids_logprob,
                                      token_ids_logprob_positions=token_ids_logprob_positions,
                                      return_routed_experts=return_routed_experts,
                                      routed_experts_start_len=routed_experts_start_len,
                                      lora_path=lora_path, bootstrap=bootstrap_fields({
                                          "bootstrap_host": bootstrap_host,
                                          "bootstrap_port": bootstrap_port,
                                          "bootstrap_room": bootstrap_room}))
        if stream:
            return self._stream(states[0], return_text_in_logprobs)
        try:
            results = await asyncio.gather(*(self.tm.async_wait(st) for st in states))
        except asyncio.CancelledError:
            for st in states:
                self.tm.abort(rid=st.req.rid)
            raise
        return self._finish(list(results), single, return_text_in_logprobs)

    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False,
                      abort_message: Optional[str] = None) -> None:
        """Abort the request ``rid`` and every request of the group it names: the ``n > 1``
        samples and batch members a generate call with that ``rid`` made (waiting or
        running); with ``prefix``, every request whose rid starts with ``rid``; or every
        request (``abort_all``). ``abort_message``: what their finish reason says."""
        if prefix and not rid:
            raise ValueError("rid: a prefix abort needs a non-empty rid prefix")
        self.tm.abort(rid=rid or None, abort_all=abort_all, prefix=prefix,
                      message=abort_message)

    # -- control ---------------------------------------------------------------------------------
    def _call(self, method: str, **kwargs: Any) -> ControlResult:
        return self.tm.call(method, **kwargs)

    def _result(self, method: str, **kwargs: Any) -> Any:
        return _raise_for(self._call(method, **kwargs))

    def flush_cache(self) -> bool:
        return self._call("flush_cache").success

    def check_integrity(self) -> dict[str, Any]:
        """Prove the KV invariant (free + cached + owned == total); raises if broken."""
        r = self._call("check_integrity")
        if not r.success:
            raise AssertionError(r.message)
        return r.result

    def get_model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` fields, with our ``context_length`` and ``vocab_size``."""
        with open(os.path.join(self.config.model_path, "config.json")) as f:
            hf_config = json.load(f)
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.get_weight_version(),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": hf_config.get("model_type"),
            "architectures": self.tm.server_info.get("architectures"),
            "context_length": self.tm.context_len,
            "vocab_size": self.tm.vocab_size,
        }

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's ``get_server_info``: every field of its ``ServerArgs`` as this engine runs
        it (``rollout_engine/compat/server_args.py``: ours as configured, ignored ones as
        given, the rest at SGLang's defaults, e.g. ``gpu_id_step`` 1), ``num_gpus``
        (``dp_size * tp_size``), our own flags, its scheduler info (``status``,
        ``max_total_num_tokens``, ``max_req_input_len``), ``internal_states`` (one per DP rank: the flags plus
        ``last_gen_throughput``, ``memory_usage`` in GB, ``effective_max_running_requests_per_dp``)
        and ``version``. ``version`` is rollout_engine's, not SGLang's: the SGLang releases whose
        flags and routes we follow are ``sglang_compatible_versions``. Then our own state:
        ``num_running_reqs``, ``num_waiting_reqs``, ``stats``, ``released_memory``, ..."""
        r = self._call("get_server_info")
        if not r.success:
            raise RuntimeError(r.message)
        runtime = dict(r.result)
        internal = runtime.pop("internal_state")
        per_rank = runtime.pop("dp_internal_states", [internal])   # one per DP replica
        config = self.config.to_dict()
        view = server_args_view(config)
        del config[IGNORED_ARGS_FIELD]   # reported under their own names, in ``view``
        # every GPU the server drives (slime sizes its weight-update group by it)
        flags = {**view, **config, "random_seed": self.tm.random_seed,
                 "num_gpus": self.config.dp_size * self.config.tp_size}
        return {**flags, **runtime, "internal_states": [{**flags, **x} for x in per_rank],
                "version": rollout_engine_version(),
                "sglang_compatible_versions": list(SGLANG_VERSIONS)}

    # -- RL control plane ------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        """Sleep: free ``tags`` (weights, kv_cache, cuda_graph; None = all). Raises
        EngineBusyError while requests hold KV."""
        return _raise_for(self._call("release_memory_occupation", tags=tags))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        return _raise_for(self._call("resume_memory_occupation", tags=tags))

    def _update(self, method: str, lease: Optional[ShmLease] = None,
                **kwargs: Any) -> tuple[bool, str]:
        """Send `method`; `lease` (the shared memory its payload lends) is released once the
        call is answered, whatever the answer, or could not be sent."""
        lease = lease if lease is not None else ShmLease()
        sending = getattr(self._sending, "box", None)
        if sending is not None:        # inside send_call: send now, answer later
            sending.append(_releasing(self.tm.start_call(method, **kwargs), lease))
            return True, "sent"
        with lease:
            return self._update_answer(self._call(method, **kwargs))

    @staticmethod
    def _update_answer(r: ControlResult) -> tuple[bool, str]:
        if r.success:
            return True, f"updated to weight_version {r.result['weight_version']}"
        return False, r.message

    def send_call(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], tuple[bool, str]]:
        """Send one weight-update call (``update_weights_from_disk`` / ``_tensor`` /
        ``_distributed``, same arguments) now, in the caller's thread, and return a function
        that waits for its answer. Calls sent one after another reach the scheduler in that
        order, so a trainer may send bucket k+1 before bucket k is answered
        (``trainer_bridge.transports.base.start_call``)."""
        if method not in SENDABLE_CALLS:
            raise ValueError(f"method: send_call takes one of {SENDABLE_CALLS}, got {method!r}")
        box: list[Callable[[], ControlResult]] = []
        self._sending.box = box
        try:
            getattr(self, method)(*args, **kwargs)
        finally:
            self._sending.box = None
        waiter = box[0]
        return lambda: self._update_answer(waiter())

    # The update methods take every field of SGLang's *ReqInput (extras keyword-only): the
    # scheduler honours what it can and refuses the rest naming the field (rl_control).
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, *, is_async: bool = False,
                                 torch_empty_cache: bool = False, keep_pause: bool = False,
                                 recapture_cuda_graph: bool = False, token_step: int = 0,
                                 manifest: Optional[dict[str, Any]] = None,
                                 pp_rank: Optional[int] = None, selector: Optional[str] = None,
                                 draft_model_path: Optional[str] = None) -> tuple[bool, str]:
        """Reload every weight from a checkpoint directory; ``weight_version`` is left
        unchanged unless given (SGLang). ``selector`` / ``draft_model_path``: a STANDALONE
        draft's refit (``control/draft_refit.py``)."""
        return self._update("update_weights_from_disk", model_path=model_path,
                            load_format=load_format, weight_version=weight_version,
                            flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                            is_async=is_async, torch_empty_cache=torch_empty_cache,
                            keep_pause=keep_pause, recapture_cuda_graph=recapture_cuda_graph,
                            token_step=token_step, manifest=manifest, pp_rank=pp_rank,
                            selector=selector, draft_model_path=draft_model_path)

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Optional[str] = None,
                                   flush_cache: bool = True,
                                   weight_version: Optional[str] = None, *,
                                   abort_all_requests: bool = False,
                                   disable_draft_model: Optional[bool] = None,
                                   torch_empty_cache: bool = False,
                                   pp_rank: Optional[int] = None,
                                   selector: Optional[str] = None) -> tuple[bool, str]:
        """``named_tensors``: (name, tensor) pairs, a FlattenedBucket (or a list of them) for
        ``load_format="flattened_bucket"``, or already-serialized payload strings. Tensors travel
        as handles (shared memory / CUDA IPC); keep them unmodified until this returns (with
        ``send_call``: until its answer). Their shared memory is lent for the call and let go
        once it is answered, whatever the answer (``protocol/shm_lease.py``). A floating tensor
        of another floating dtype is cast into the parameter."""
        lease = ShmLease()
        if isinstance(named_tensors, list) and named_tensors and isinstance(named_tensors[0], str):
            serialized = named_tensors
        else:
            if not isinstance(named_tensors, (list, tuple, dict)) and hasattr(named_tensors,
                                                                             "__iter__"):
                named_tensors = list(named_tensors)   # e.g. model.named_parameters()
            text, lease = lend_named_tensors(named_tensors)
            serialized = [text]
        return self._update("update_weights_from_tensor", lease,
                            serialized_named_tensors=serialized,
                            load_format=load_format, flush_cache=flush_cache,
                            weight_version=weight_version, abort_all_requests=abort_all_requests,
                            disable_draft_model=disable_draft_model,
                            torch_empty_cache=torch_empty_cache, pp_rank=pp_rank,
                            selector=selector)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> tuple[bool, str]:
        r = self._call("init_weights_update_group", master_address=master_address,
                       master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                       group_name=group_name, backend=backend)
        return r.success, r.message or "ok"

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        load_format: Optional[str] = None,
                                        flush_cache: bool = True,
                                        weight_version: Optional[str] = None, *,
                                        abort_all_requests: bool = False,
                                        torch_empty_cache: bool = False,
                                        pp_rank: Optional[int] = None,
                                        selector: Optional[str] = None) -> tuple[bool, str]:
        """Receive one broadcast from rank 0 of ``group_name``: the tensors (or, with
        ``load_format="flattened_bucket"``, their bytes back to back) in the declared
        ``dtypes`` (names or torch dtypes); floating ones are cast into the parameters."""
        return self._update("update_weights_from_distributed", names=names,
                            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
                            shapes=[list(s) for s in shapes], group_name=group_name,
                            load_format=load_format, flush_cache=flush_cache,
                            weight_version=weight_version, abort_all_requests=abort_all_requests,
                            torch_empty_cache=torch_empty_cache, pp_rank=pp_rank,
                            selector=selector)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> tuple[bool, str]:
        r = self._call("destroy_weights_update_group", group_name=group_name)
        return r.success, r.message or "ok"

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return _raise_for(self._call("get_weights_by_name", name=name,
                                     truncate_size=truncate_size)).tolist()

    def get_weight_version(self) -> str:
        return _raise_for(self._call("get_weight_version"))["weight_version"]

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        """Relabel the weights (their KV stays valid); like SGLang's route, it aborts running
        requests unless ``abort_all_requests=False``."""
        return _raise_for(self._call("update_weight_version", new_version=new_version,
                                     abort_all_requests=abort_all_requests))["weight_version"]

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """``abort`` in-flight requests, ``retract`` them to the queue (KV freed, recomputed
        after continue), or keep them ``in_place``. New requests wait while paused."""
        return _raise_for(self._call("pause_generation", mode=mode))

    def continue_generation(self) -> dict[str, Any]:
        return _raise_for(self._call("continue_generation"))

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.tm.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # A finalizer only records: the frontend's receiver thread sees the flag and shuts the
        # scheduler down from ordinary code (a shutdown sends and waits).
        tm = getattr(self, "tm", None)
        if tm is not None:
            tm.orphaned = True


_SGLANG_KWARGS = GENERATE_REQUEST.names(Treatment.DEFAULT_ONLY, Treatment.IGNORED)


def _check_sglang_kwargs(kwargs: dict[str, Any]) -> None:
    """SGLang's generate keyword arguments beyond the ones ``generate`` names."""
    for name in kwargs:
        if name not in _SGLANG_KWARGS:
            hint = " (the prompt is prompt=)" if name == "text" else ""
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}{hint}; "
                            "neither this engine nor SGLang's GenerateReqInput has it")
    GENERATE_REQUEST.check(kwargs, "generate")


def _releasing(wait: Callable[[], ControlResult], lease: ShmLease
               ) -> Callable[[], ControlResult]:
    """`wait`, `lease` released once it returned or raised."""
    def wait_then_release() -> ControlResult:
        with lease:
            return wait()
    return wait_then_release


def _raise_for(result: ControlResult) -> Any:
    """Python callers get exceptions: 400 -> ValueError, 409 -> busy, 503 -> asleep/dead."""
    if result.success:
        return result.result
    if result.status == 400:
        raise ValueError(result.message)
    if result.status == 409:
        raise EngineBusyError(result.message)
    if result.status == 503:
        raise EngineAsleepError(result.message)
    raise RuntimeError(result.message)
