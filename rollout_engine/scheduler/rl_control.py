"""RL control calls: sleep / wake by memory tag, weight refit, pause modes, weight versions.

All run between batches in the scheduler process. A refit validates before it changes
anything, bumps the weight version (so the radix cache never matches KV computed under older
weights) and frees the stale cache entries.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from rollout_engine.memory.memory_saver import TAGS
from rollout_engine.memory.prefix_cache import CacheNamespace
from rollout_engine.protocol.messages import AbortReq
from rollout_engine.scheduler.control import BusyError
from rollout_engine.scheduler.request import ReqState
from rollout_engine.weights import refit
from rollout_engine.weights.loader import LoadReport, read_weight

if TYPE_CHECKING:
    from rollout_engine.scheduler.scheduler import Scheduler

PAUSE_MODES = ("abort", "retract", "in_place")


def _tags(tags: Optional[list[str]]) -> list[str]:
    if tags is None:
        return list(TAGS)
    if not isinstance(tags, list) or not all(t in TAGS for t in tags):
        raise ValueError(f"tags: must be a subset of {list(TAGS)}, got {tags!r}")
    return tags


def _dtype_name(d: str) -> str:
    return d.removeprefix("torch.") if isinstance(d, str) else d


class RLControl:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.num_refits = 0

    # -- sleep / wake --------------------------------------------------------------------------
    def rpc_release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        tags = _tags(tags)
        s = self.s
        holding = [r.rid for r in s.active_reqs()]
        if holding:
            raise BusyError(f"cannot release memory while {len(holding)} request(s) hold KV; "
                            "pause_generation(mode='retract' or 'abort') or wait until idle")
        if s.waiting and not s.paused:
            raise BusyError(f"cannot release memory while {len(s.waiting)} request(s) wait; "
                            "pause_generation first")
        t0 = time.perf_counter()
        if "kv_cache" in tags and "kv_cache" not in s.memory_saver.released:
            s.kv.tree.reset()           # the tree's slots point into the pool being released
            s.allocator.reset()
        freed = s.memory_saver.release(tags)
        return {"released": sorted(s.memory_saver.released), "bytes_freed": freed,
                "seconds": time.perf_counter() - t0}

    def rpc_resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        tags = _tags(tags)
        s = self.s
        t0 = time.perf_counter()
        if s.memory_saver.resume(tags):
            s.weights_stale = True
        return {"released": sorted(s.memory_saver.released), "weights_stale": s.weights_stale,
                "seconds": time.perf_counter() - t0}

    # -- refit ---------------------------------------------------------------------------------
    def _apply(self, load: Any, weight_version: Optional[str], flush_cache: bool
               ) -> dict[str, Any]:
        s = self.s
        if "weights" in s.memory_saver.released:
            raise BusyError("weights are released; resume_memory_occupation(['weights']) first")
        t0 = time.perf_counter()
        report: LoadReport = load()
        self.num_refits += 1
        old = s.weight_version
        s.weight_version = (weight_version if weight_version is not None
                            else _next_version(old, self.num_refits))
        s.weights_stale = False
        # KV computed under `old` can never be matched again; free what nobody is using
        s.kv.tree.evict_namespaces_except(CacheNamespace(s.weight_version, None))
        if flush_cache and not s.active_reqs():
            s.kv.tree.reset()
        return {"weight_version": s.weight_version, "num_tensors": report.num_tensors,
                "num_bytes": report.num_bytes, "seconds": time.perf_counter() - t0}

    def rpc_update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                     weight_version: Optional[str] = None,
                                     flush_cache: bool = True,
                                     abort_all_requests: bool = False) -> dict[str, Any]:
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format: {load_format!r} is not supported for disk "
                             "(None, 'auto', 'safetensors')")
        if abort_all_requests:
            self.s.abort(AbortReq(abort_all=True, message="aborted for a weight update"))
        return self._apply(lambda: refit.refit_from_disk(self.s.runner.model, model_path),
                           weight_version, flush_cache)

    def rpc_update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                       load_format: Optional[str] = None,
                                       flush_cache: bool = True,
                                       weight_version: Optional[str] = None) -> dict[str, Any]:
        model = self.s.runner.model
        return self._apply(lambda: refit.refit_from_serialized(
            model, serialized_named_tensors, load_format), weight_version, flush_cache)

    def rpc_init_weights_update_group(self, master_address: str, master_port: int,
                                      rank_offset: int, world_size: int,
                                      group_name: str = "weight_update_group",
                                      backend: str = "nccl") -> dict[str, Any]:
        self.s.update_groups.init(master_address, master_port, rank_offset, world_size,
                                  group_name, backend)
        return {"group_name": group_name}

    def rpc_update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                            shapes: list[list[int]],
                                            group_name: str = "weight_update_group",
                                            load_format: Optional[str] = None,
                                            flush_cache: bool = True,
                                            weight_version: Optional[str] = None
                                            ) -> dict[str, Any]:
        from rollout_engine.weights.loader import load_weights

        received = self.s.update_groups.receive(
            list(names), [_dtype_name(d) for d in dtypes], shapes, group_name, load_format)
        return self._apply(lambda: load_weights(self.s.runner.model, received, strict_dtype=True),
                           weight_version, flush_cache)

    def rpc_destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                         ) -> dict[str, Any]:
        self.s.update_groups.destroy(group_name)
        return {"group_name": group_name}

    def rpc_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        if "weights" in self.s.memory_saver.released:
            raise BusyError("weights are released")
        t = read_weight(self.s.runner.model, name)
        return (t[:truncate_size] if t.dim() else t).float().tolist()

    # -- versions and pausing -------------------------------------------------------------------
    def rpc_get_weight_version(self) -> dict[str, Any]:
        return {"weight_version": self.s.weight_version}

    def rpc_update_weight_version(self, new_version: str) -> dict[str, Any]:
        if not isinstance(new_version, str) or not new_version:
            raise ValueError("new_version: must be a non-empty string")
        self.s.weight_version = new_version
        self.s.kv.tree.evict_namespaces_except(CacheNamespace(new_version, None))
        return {"weight_version": new_version}

    def rpc_pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")
        s = self.s
        s.paused = True
        affected = len(s.by_rid)
        if mode == "abort":
            s.abort(AbortReq(abort_all=True, message="aborted by pause_generation"))
        elif mode == "retract":
            for req in sorted(s.active_reqs(), key=lambda r: r.arrival, reverse=True):
                if req in s.running:
                    s.running.remove(req)
                if s.chunked is req:
                    s.chunked = None
                s.retract(req)
        return {"mode": mode, "affected": affected}

    def rpc_continue_generation(self) -> dict[str, Any]:
        self.s.paused = False
        return {"paused": False}


def _next_version(old: str, count: int) -> str:
    """Auto-versions for refits that name none: integers count up, anything else gets a suffix."""
    if old.isdigit():
        return str(int(old) + 1)
    return str(count)


__all__ = ["RLControl", "PAUSE_MODES", "ReqState"]
