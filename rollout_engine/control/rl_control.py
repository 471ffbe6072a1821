"""RL control calls: sleep / wake by memory tag, weight refit, pause modes, weight versions.

All run between batches in the scheduler process. A refit validates before it changes
anything, then bumps the weight *generation*, an internal counter that keys the radix cache
(the user's ``weight_version`` is only a label: reusing it, or relabelling with
``update_weight_version``, neither hides nor invalidates KV). Every successful load, a single
tensor or one bucket of a partial sync included, is a new generation.

A request already running when the weights change keeps its KV and finishes on the new
weights (as in SGLang; its ``weight_versions`` spans show where the label changed). Its
old-generation KV is never matched by later requests and is freed when it finishes, not cached; a ``flush_cache``
asked for while such requests hold KV is deferred to the next moment none does.

After a wake without a CPU backup the weights are zeros: generation is refused until every
weight of the model has been written again (``WeightState.missing`` counts down per refit).

As in SGLang, a refit changes ``weight_version`` only when it names one (verl refits bucket by
bucket and names none), and the update calls take every field of SGLang's ``*ReqInput``: what
we can honour is honoured (``abort_all_requests``, ``torch_empty_cache``, ``keep_pause``,
``recapture_cuda_graph``: CUDA graphs read the parameters in place, so they need none), the
rest is accepted at its default and refused otherwise, naming the field (`_check_flags`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, Unpack

import torch
from torch import nn

from rollout_engine.compat.update_requests import SglangUpdateFlags
from rollout_engine.control.rl_broadcast import BroadcastRefits
from rollout_engine.control.serving import Serving
from rollout_engine.control.weight_checks import WeightChecks
from rollout_engine.memory.kv_pool import PageAllocator
from rollout_engine.memory.memory_saver import TAGS, MemorySaver
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.protocol.messages import AbortReq, BusyError, WeightSlice
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.request import ReqState
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.speculative.selector import SELECTORS, check_target_only
from rollout_engine.weights import refit
from rollout_engine.weights.disk_reader import PartialLoadError
from rollout_engine.weights.loader import (
    WeightLoadReport,
    covered_names,
    read_weight,
    weight_names,
)
from rollout_engine.weights.shadow import ShadowWeights
from rollout_engine.weights.update_groups import WeightUpdateGroups

PAUSE_MODES = ("abort", "retract", "in_place")
MAX_TRUNCATE_ROWS = 1024        # get_weights_by_name: rows a read may return
MAX_WEIGHT_ELEMENTS = 1 << 20   # ... and elements (one memcpy in the loop; lists outside)


def _tags(tags: Optional[list[str]]) -> list[str]:
    if tags is None:
        return list(TAGS)
    if not isinstance(tags, list) or not all(t in TAGS for t in tags):
        raise ValueError(f"tags: must be a subset of {list(TAGS)}, got {tags!r}")
    return tags


def _check_flags(*, weight_version: Optional[str] = None, is_async: bool = False,
                 keep_pause: bool = False, token_step: int = 0,
                 manifest: Optional[dict[str, Any]] = None, pp_rank: Optional[int] = None,
                 selector: Optional[str] = None, draft_model_path: Optional[str] = None,
                 **flags: Any) -> None:
    """Refuse, naming the field, an SGLang update flag this engine cannot honour; ``flags`` are
    booleans that are all honoured (or trivially true here). ``selector`` / ``draft_model_path``
    reach here only without a draft model (``draft_refit.py`` routes them)."""
    check_target_only(selector, draft_model_path)
    if weight_version is not None and not isinstance(weight_version, str):
        raise ValueError(f"weight_version: must be a string or null, got {weight_version!r}")
    for name, value in {"is_async": is_async, "keep_pause": keep_pause, **flags}.items():
        if not isinstance(value, bool) and not (name == "disable_draft_model" and value is None):
            raise ValueError(f"{name}: must be true or false, got {value!r}")
    if is_async:
        raise ValueError("is_async: asynchronous disk updates are not supported here; the "
                         "update runs between batches (leave is_async false)")
    if not isinstance(token_step, int) or isinstance(token_step, bool) or token_step < 0:
        raise ValueError(f"token_step: must be a non-negative integer, got {token_step!r}")
    if manifest is not None:
        raise ValueError("manifest: checkpoint manifests are not supported; leave it null")
    if pp_rank not in (None, 0):
        raise ValueError(f"pp_rank: this engine has one pipeline stage, so only 0 (or null) is "
                         f"valid, got {pp_rank!r}")


class RLControl(BroadcastRefits):
    """The RL control calls over the scheduler's request side (``serving``), its runner, KV
    and memory, and the weight state it serves with; ``groups`` (the weight-update groups) and
    the trainer's memory kept mapped are this object's own."""

    def __init__(self, *, serving: Serving, runner: ModelRunner, kv: KVManager,
                 allocator: PageAllocator, memory_saver: MemorySaver, weights: WeightState,
                 groups: WeightUpdateGroups, group_timeout_s: float) -> None:
        self.serving = serving
        self.runner = runner
        self.kv = kv
        self.allocator = allocator
        self.memory_saver = memory_saver
        self.weights = weights
        self.groups = groups
        self.group_timeout_s = group_timeout_s   # weight_update_group_timeout
        self.mapped: Optional[refit.MappedStorages] = None  # trainer shm kept mapped (1st refit)
        self.shadow: Optional[ShadowWeights] = None   # spare weights a broadcast lands in
        self.num_refits = 0
        self.session: Optional[str] = None   # an open weight-update session's selector
        tp_size = runner.tp.size if runner.tp is not None else 1
        self.checks = WeightChecks(self.checked_models, serving, kv, weights, memory_saver,
                                   tp_size)

    def checked_models(self, selector: str) -> list[tuple[str, nn.Module]]:
        """The (role, model) pairs ``selector`` names: the target, unless it says draft."""
        return [("target", self.runner.model)] if selector in ("target", "all") else []

    def spare_bytes(self) -> int:
        """Bytes of spare parameter storage held for broadcasts (``weights/shadow.py``)."""
        return self.shadow.num_bytes if self.shadow is not None else 0

    def _stale_info(self) -> dict[str, Any]:
        stale = self.weights.stale
        return {"weights_stale": stale, "weights_missing": len(self.weights.missing),
                "stale_reason": self.serving.refusal_reason() if stale else None}

    # -- sleep / wake --------------------------------------------------------------------------
    def rpc_release_memory_occupation(self, tags: Optional[list[str]] = None,
                                      weights_backup: Optional[bool] = None) -> dict[str, Any]:
        """Release ``tags`` once no request holds KV. ``weights_backup``: keep the weights in
        CPU memory for the wake (vLLM's sleep level 1) or not (level 2: stale after the wake
        until refitted); None: the engine's ``enable_weights_cpu_backup``."""
        tags = _tags(tags)
        s, saver = self.serving, self.memory_saver
        self._refuse_while_receiving("release_memory_occupation")
        holding = [r.rid for r in s.active_reqs()]
        if holding:
            raise BusyError(f"cannot release memory while {len(holding)} request(s) hold KV; "
                            "pause_generation(mode='retract' or 'abort') or wait until idle")
        if s.waiting and not s.paused:
            raise BusyError(f"cannot release memory while {len(s.waiting)} request(s) wait; "
                            "pause_generation first")
        t0 = time.perf_counter()
        if "kv_cache" in tags and "kv_cache" not in saver.released:
            self.kv.tree.reset()        # the tree's slots point into the pool being released
            self.allocator.reset()
            self.weights.flush_pending = False
        if "weights" in tags and self.mapped is not None:
            # a sleeping engine pins none of the trainer's shm, nor (through the refit plans
            # kept with it) any parameter storage the release frees
            self.mapped.clear()
        freed = saver.release(tags, weights_backup)
        if "weights" in tags:
            self.groups.release_buffers()       # nor a broadcast receive buffer
            if self.shadow is not None:
                self.shadow.release()           # nor spare parameter storage
        return {"released": sorted(saver.released), "bytes_freed": freed,
                "seconds": time.perf_counter() - t0}

    def rpc_resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        tags = _tags(tags)
        t0 = time.perf_counter()
        if self.memory_saver.resume(tags):
            self.weights.zeroed(weight_names(self.runner.model))
        return {"released": sorted(self.memory_saver.released), **self._stale_info(),
                "seconds": time.perf_counter() - t0}

    # -- refit ---------------------------------------------------------------------------------
    def _before_update(self, abort_all_requests: bool, **flags: Any) -> None:
        """Refuse flags we cannot honour (`_check_flags`) and updates while the weights are
        released; honour ``abort_all_requests``."""
        _check_flags(abort_all_requests=abort_all_requests, **flags)
        if "weights" in self.memory_saver.released:
            raise BusyError("weights are released; resume_memory_occupation(['weights']) first")
        if abort_all_requests:
            self.serving.abort(AbortReq(abort_all=True, message="aborted for a weight update"))

    def _apply(self, load: Any, weight_version: Optional[str], flush_cache: bool,
               torch_empty_cache: bool = False, keep_pause: bool = False) -> dict[str, Any]:
        device, weights = self.runner.device, self.weights
        t0 = time.perf_counter()
        report: WeightLoadReport = load()
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # the trainer may reuse its buffers once we answer
        self.num_refits += 1
        generation = weights.loaded(covered_names(self.runner.model, report.names),
                                    weight_version)
        # older KV can never be matched again: free it now, or as soon as its last user ends
        self.kv.tree.retire_generations_before(generation)
        deferred = False
        if flush_cache:
            if self.serving.active_reqs():
                weights.flush_pending = deferred = True
            else:
                self.kv.flush()
                weights.flush_pending = False
        if torch_empty_cache and device.type == "cuda":
            torch.cuda.empty_cache()
        if keep_pause:
            self.serving.paused = True     # as after pause_generation(mode="in_place")
        return {"weight_version": weights.version, "weight_generation": generation,
                "num_tensors": report.num_tensors, "num_bytes": report.num_bytes,
                "num_cast": report.num_cast, "flush_deferred": deferred, **self._stale_info(),
                "seconds": time.perf_counter() - t0}

    def rpc_update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                     weight_version: Optional[str] = None,
                                     flush_cache: bool = True,
                                     abort_all_requests: bool = False,
                                     torch_empty_cache: bool = False, keep_pause: bool = False,
                                     **sglang_flags: Unpack[SglangUpdateFlags]
                                     ) -> dict[str, Any]:
        """``sglang_flags``: is_async, recapture_cuda_graph, token_step, manifest, pp_rank."""
        return self._disk_update(lambda: self._read_checkpoint(model_path), load_format,
                                 weight_version, flush_cache, abort_all_requests,
                                 torch_empty_cache, keep_pause, **sglang_flags)

    def _disk_update(self, load: Callable[[], WeightLoadReport], load_format: Optional[str],
                     weight_version: Optional[str], flush_cache: bool,
                     abort_all_requests: bool, torch_empty_cache: bool, keep_pause: bool,
                     **sglang_flags: Unpack[SglangUpdateFlags]) -> dict[str, Any]:
        """A disk refit's checks, then `load` (what reads the checkpoint) applied."""
        self._refuse_while_receiving("update_weights_from_disk")
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format: {load_format!r} is not supported for disk "
                             "(None, 'auto', 'safetensors')")
        self._before_update(abort_all_requests, weight_version=weight_version,
                            flush_cache=flush_cache, torch_empty_cache=torch_empty_cache,
                            keep_pause=keep_pause, **sglang_flags)
        return self._apply(load, weight_version, flush_cache, torch_empty_cache, keep_pause)

    def _read_checkpoint(self, model_path: str) -> WeightLoadReport:
        try:
            return refit.refit_from_disk(self.runner.model, model_path)
        except PartialLoadError as e:
            # some weights may be half overwritten: refuse generation until they are rewritten
            self.kv.tree.retire_generations_before(
                self.weights.partly_written(covered_names(self.runner.model, e.names)))
            raise ValueError(str(e)) from None

    def rpc_update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                       load_format: Optional[str] = None,
                                       flush_cache: bool = True,
                                       weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False,
                                       torch_empty_cache: bool = False,
                                       read_by_others: bool = False,
                                       **sglang_flags: Unpack[SglangUpdateFlags]
                                       ) -> dict[str, Any]:
        """``sglang_flags``: disable_draft_model (no draft model here), pp_rank.
        ``read_by_others`` (set by the data-parallel host, not a client): another replica
        reads the same payload and drops the sender's shm references. A call refused before
        its payload is read drops the references a sender using torch's protocol took for
        it (our own senders lend theirs and keep them: ``protocol/shm_lease.py``). Where the
        tensors go is ``_tensor_destination``'s (a draft engine routes them by selector)."""
        model: nn.Module = self.runner.model
        load: Optional[Callable[[refit.NamedTensors], WeightLoadReport]] = None
        try:
            model, load = self._tensor_destination(sglang_flags)
            self._refuse_while_receiving("update_weights_from_tensor")
            self._before_update(abort_all_requests, weight_version=weight_version,
                                flush_cache=flush_cache, torch_empty_cache=torch_empty_cache,
                                **sglang_flags)
        except Exception:
            if not read_by_others:
                refit.drop_unread(model, serialized_named_tensors)
            raise
        if self.mapped is None:     # sized from the model once: its weights never change size
            self.mapped = refit.MappedStorages.for_model(model)
        mapped = self.mapped
        return self._apply(lambda: refit.refit_from_serialized(
            model, serialized_named_tensors, load_format, mapped, read_by_others, load=load),
            weight_version, flush_cache, torch_empty_cache)

    def _tensor_destination(self, flags: SglangUpdateFlags
                            ) -> tuple[nn.Module, Optional[Callable[[refit.NamedTensors],
                                                                    WeightLoadReport]]]:
        """The model a tensor update is read against and how its tensors are written
        (``None``: all into that model). ``flags`` may be consumed."""
        return self.runner.model, None

    def cancel_update_weights_from_tensor(self, kwargs: dict[str, Any]) -> None:
        """A tensor update cancelled before it ran: drop the references a torch-protocol
        sender took for its reader, unless another replica reads the payload."""
        if not kwargs.get("read_by_others"):
            refit.drop_unread(self.runner.model, kwargs.get("serialized_named_tensors"))

    def rpc_get_weights_by_name(self, name: str, truncate_size: int = 100) -> WeightSlice:
        """The first ``truncate_size`` rows of a weight, bounded (a debugging read)."""
        if (not isinstance(truncate_size, int) or isinstance(truncate_size, bool)
                or not 1 <= truncate_size <= MAX_TRUNCATE_ROWS):
            raise ValueError(f"truncate_size: must be an integer in [1, {MAX_TRUNCATE_ROWS}] "
                             f"(rows of the weight to return), got {truncate_size!r}")
        if "weights" in self.memory_saver.released:
            raise BusyError("weights are released")
        t = read_weight(self.runner.model, name)
        part = t[:truncate_size] if t.dim() else t
        if part.numel() > MAX_WEIGHT_ELEMENTS:
            row = max(1, part[0].numel()) if part.dim() else 1
            raise ValueError(f"truncate_size: {truncate_size} rows of {name!r} hold "
                             f"{part.numel()} elements, over the {MAX_WEIGHT_ELEMENTS} one read "
                             f"may return; ask for at most {MAX_WEIGHT_ELEMENTS // row} rows")
        flat = part.detach().float().contiguous().cpu()
        return WeightSlice(list(flat.shape), flat.numpy().tobytes())

    # -- the weight-update session ---------------------------------------------------------------
    def rpc_begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        """SGLang's ``begin_weight_update``: opens the session a trainer brackets its update
        with (miles does, around every refit), recording ``selector``. The weights are written
        in place, so there is nothing to unpack; updates outside a session are served too
        (slime, verl and AReaL never open one). A second begin before an end is refused."""
        if selector not in SELECTORS:
            raise ValueError(f"selector: must be one of {list(SELECTORS)}, got {selector!r}")
        if self.session is not None:
            raise ValueError(f"begin_weight_update: a weight-update session (selector "
                             f"{self.session!r}) is already open; call end_weight_update first")
        self.session = selector
        return {"selector": selector}

    def rpc_end_weight_update(self) -> dict[str, Any]:
        """SGLang's ``end_weight_update``: closes the session (every write has already taken
        effect; nothing is post-processed). The answer says whether weights are still
        unwritten (``weights_stale``: after a wake without a backup, or ``reset_tensors``)."""
        if self.session is None:
            raise ValueError("end_weight_update: no weight-update session is open; call "
                             "begin_weight_update first")
        selector, self.session = self.session, None
        return {"selector": selector, **self._stale_info()}

    def rpc_post_process_weights(self, restore_weights_before_load: bool = False,
                                 post_process_quantization: bool = False,
                                 post_load_weights: bool = False) -> dict[str, Any]:
        """SGLang's ``post_process_weights`` (slime calls it around a quantized refit: restore
        before the update, post-process after). Nothing is to do here for any flag: a
        quantized model's refit quantizes in its copy and writes the layout it serves
        (``quantization/convert.py``), and its packed copies are redone at the first product
        after a write. Answers which quantization that is."""
        _check_flags(restore_weights_before_load=restore_weights_before_load,
                     post_process_quantization=post_process_quantization,
                     post_load_weights=post_load_weights)
        return {"quantization": getattr(self.runner, "quantization", None)}

    # -- versions and pausing -------------------------------------------------------------------
    def rpc_get_weight_version(self) -> dict[str, Any]:
        return {"weight_version": self.weights.version}

    def rpc_update_weight_version(self, new_version: str, abort_all_requests: bool = False
                                  ) -> dict[str, Any]:
        if not isinstance(new_version, str) or not new_version:
            raise ValueError("new_version: must be a non-empty string")
        _check_flags(abort_all_requests=abort_all_requests)
        if abort_all_requests:
            self.serving.abort(AbortReq(abort_all=True,
                                        message="aborted for a weight version update"))
        self.weights.version = new_version    # a label: the weights and their KV stay valid
        return {"weight_version": new_version}

    def rpc_pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")
        s = self.serving
        s.paused = True
        affected = len(s.by_rid)
        if mode == "abort":
            s.abort(AbortReq(abort_all=True, message="aborted by pause_generation"))
        elif mode == "retract":
            for req in sorted(s.active_reqs(), key=lambda r: r.arrival, reverse=True):
                s.retract(req)
        return {"mode": mode, "affected": affected}

    def rpc_continue_generation(self) -> dict[str, Any]:
        """Resume scheduling. Asleep or with stale weights nothing could ever run: requests
        queued during the pause are refused with the reason instead of waiting forever."""
        s = self.serving
        s.paused = False
        refused = 0
        if not s.can_run and s.by_rid:
            refused = s.abort(AbortReq(abort_all=True, message=s.refusal_reason()))
        return {"paused": False, "refused": refused}


__all__ = ["RLControl", "PAUSE_MODES", "ReqState"]
