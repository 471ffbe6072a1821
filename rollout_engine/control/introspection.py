"""Cache and introspection calls: flush the prefix cache, check the KV invariants, the server's
runtime state (``get_server_info``) and its load (SGLang's ``/get_load`` and ``/v1/loads``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollout_engine.control.serving import Serving
from rollout_engine.memory.kv_pool import PageAllocator
from rollout_engine.memory.memory_saver import MemorySaver
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.protocol.messages import BusyError, LoadReport
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.weights.update_groups import WeightUpdateGroups


class Introspection:
    """``spare_bytes``: parameter storage held by the RL control for broadcasts (counted with
    the update groups' receive buffers)."""

    def __init__(self, serving: Serving, runner: ModelRunner, kv: KVManager,
                 allocator: PageAllocator, memory_saver: MemorySaver, weights: WeightState,
                 groups: WeightUpdateGroups, spare_bytes: Callable[[], int]) -> None:
        self.serving = serving
        self.runner = runner
        self.kv = kv
        self.allocator = allocator
        self.memory_saver = memory_saver
        self.weights = weights
        self.groups = groups
        self.spare_bytes = spare_bytes
        self.throughput = ThroughputMeter()

    def rpc_flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache unless a request holds KV (running, or its prompt being
        chunked): 409 then. Requests that only wait hold none, so they do not stop a flush:
        those retracted by ``pause_generation(mode="retract")`` are recomputed from their
        tokens when generation continues, as SGLang documents for that mode (miles pauses so,
        then retries ``GET /flush_cache`` until it answers 200, while nothing can change)."""
        holding = self.serving.active_reqs()
        if holding:
            raise BusyError(f"cannot flush the cache while {len(holding)} request(s) hold KV "
                            f"({len(self.serving.by_rid)} in flight); retry when idle, or "
                            "pause_generation with mode 'retract' or 'abort' first")
        self.kv.flush()
        self.weights.flush_pending = False
        return {"flushed": True}

    def rpc_check_integrity(self) -> dict[str, Any]:
        return self.serving.check_integrity()

    def rpc_get_server_info(self) -> dict[str, Any]:
        """Runtime state, under our names and SGLang's (its ``scheduler_info`` keys and what its
        scheduler puts in ``internal_states``); the frontend adds the flags."""
        s, runner, weights, groups = self.serving, self.runner, self.weights, self.groups
        load = self.rpc_get_load()
        return {
            "status": "ready",
            "max_req_input_len": min(runner.context_len, runner.max_total_num_tokens) - 1,
            "internal_state": {
                "last_gen_throughput": load.gen_throughput,
                "memory_usage": {"weight": round(load.weight_gb, 2),
                                 "kvcache": round(load.kv_cache_gb, 2),
                                 "token_capacity": load.max_total_num_tokens,
                                 "graph": 0.0},
                "effective_max_running_requests_per_dp": load.max_running_requests,
            },
            "max_total_num_tokens": runner.max_total_num_tokens,
            "max_running_requests": runner.max_running_requests,
            "context_length": runner.context_len,
            "architectures": [runner.arch.architecture],
            "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting),
            "kv_free_tokens": self.allocator.available_size(),
            "kv_cached_tokens": self.kv.tree.total_size(),
            "weight_version": weights.version,
            "weight_generation": weights.generation,
            "paused": s.paused,
            "released_memory": sorted(self.memory_saver.released),
            "weights_stale": weights.stale,
            "weights_missing": len(weights.missing),
            "flush_pending": weights.flush_pending,
            "pending_weight_update_groups": sorted(groups.pending),
            "weight_updates_receiving": groups.receiving(),
            "weight_update_buffer_bytes": groups.buffer_bytes() + self.spare_bytes(),
            "kv_pool_bytes": runner.kv_pool.nbytes(),
            # the routing record (R3): memory per KV slot, 0 when not recorded
            "routed_experts_bytes_per_token": runner.routing.bytes_per_token,
            "routed_experts_bytes": runner.routing.nbytes(),
            "weight_bytes": runner.weight_nbytes(),
            "stats": dict(s.stats),
            "hicache": self.kv.tree.tier_stats(),   # None without lower cache tiers
            "loaded_adapters": s.lora.listing(),    # LoRA: SGLang's LoRARef fields by name
            # prefill-decode disaggregation: the role, its bootstrap port, transfers so far
            "disaggregation": s.pd.stats(),
        }

    def rpc_get_load(self) -> LoadReport:
        """The numbers behind SGLang's ``/get_load`` and ``/v1/loads``."""
        s, runner = self.serving, self.runner
        max_tokens = runner.max_total_num_tokens
        active = s.active_reqs()        # running, and the request whose prompt is being chunked
        unprefilled = [*s.waiting, *([s.chunked] if s.chunked is not None else [])]
        held = len(active) + len(s.waiting) if s.paused else 0
        stats = s.stats
        return LoadReport(
            num_running_reqs=len(active), num_waiting_reqs=len(s.waiting),
            num_used_tokens=max_tokens - self.kv.available_tokens(),
            num_waiting_tokens=sum(req.seq_len for req in s.waiting),
            num_waiting_uncached_tokens=sum(req.seq_len - req.kv_len for req in unprefilled),
            max_total_num_tokens=max_tokens, max_running_requests=runner.max_running_requests,
            gen_throughput=self.throughput.sample(stats["decode_tokens"], time.monotonic()),
            cache_hit_rate=(stats["cached_tokens"] / stats["prompt_tokens"]
                            if stats["prompt_tokens"] else 0.0),
            num_paused_reqs=held,
            num_retracted_reqs=sum(1 for req in s.waiting if req.output_ids),
            total_prefill_tokens=stats["prefill_tokens"],
            weight_gb=runner.weight_nbytes() / 2**30,
            kv_cache_gb=runner.kv_pool.nbytes() / 2**30,
            timestamp=time.time())


class ThroughputMeter:
    """Tokens per second over the window since the previous sample at least ``window_s`` old
    (SGLang's ``last_gen_throughput`` is measured over its last logging interval)."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self.since, self.tokens_then = time.monotonic(), 0
        self.rate = 0.0

    def sample(self, tokens: int, now: float) -> float:
        if now - self.since >= self.window_s:
            self.rate = (tokens - self.tokens_then) / (now - self.since)
            self.since, self.tokens_then = now, tokens
        return self.rate
