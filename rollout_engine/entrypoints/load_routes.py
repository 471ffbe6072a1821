"""SGLang's load routes, read-only and open to every user:

    /get_load   a list with one entry per DP rank (``--dp-size``; rank 0 alone by default):
                {dp_rank, num_reqs, num_waiting_reqs, num_tokens, num_pending_tokens, ts_tic};
                sgl-router sums ``num_tokens`` for its load-aware policies
    /v1/loads   {timestamp, version, dp_rank_count, accelerator, num_accelerators, loads: [...],
                aggregate}, each load SGLang's core keys (``num_running_reqs``,
                ``num_waiting_reqs``, ``num_used_tokens``, ``num_total_tokens``, ``token_usage``,
                ... and 0.5.9's ``num_total_reqs``) and the sections ``?include=`` asks for
                (core, memory, spec, lora, disagg, queues, all; default all); ``?dp_rank=``,
                ``?format=prometheus``. slime polls ``/v1/loads?include=core`` until idle.

Shapes from sglang 0.5.9 (``entrypoints/v1_loads.py``, ``GetLoadReqOutput``) and 0.5.23
(``managers/load_snapshot.py``): the union, so a reader of either finds its keys.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Optional

from fastapi import FastAPI, Request
from starlette.responses import Response

from rollout_engine.entrypoints.engine import Engine, rollout_engine_version
from rollout_engine.entrypoints.http_utils import HTTPError, json_response
from rollout_engine.protocol.messages import LoadReport

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def get_load_entry(load: LoadReport, dp_rank: int = 0) -> dict[str, Any]:
    """SGLang's ``GetLoadReqOutput`` for one DP rank."""
    return {"dp_rank": dp_rank, "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_tokens": load.num_used_tokens + load.num_waiting_tokens,
            "num_pending_tokens": load.num_waiting_uncached_tokens,
            "ts_tic": time.perf_counter()}


def v1_load_entry(load: LoadReport, include: Optional[set[str]], dp_rank: int = 0
                  ) -> dict[str, Any]:
    """One rank's entry of ``/v1/loads`` (``include`` None: every section)."""
    total_tokens = load.num_used_tokens + load.num_waiting_tokens
    entry: dict[str, Any] = {
        "timestamp": load.timestamp, "dp_rank": dp_rank,
        "num_running_reqs": load.num_running_reqs, "num_waiting_reqs": load.num_waiting_reqs,
        "num_waiting_uncached_tokens": load.num_waiting_uncached_tokens,
        "num_used_tokens": load.num_used_tokens, "num_total_tokens": total_tokens,
        "num_active_tokens": total_tokens, "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": load.max_total_num_tokens,
        "max_running_requests": load.max_running_requests,
        "token_usage": round(load.token_usage, 4),
        "gen_throughput": round(load.gen_throughput, 2),
        "cache_hit_rate": round(load.cache_hit_rate, 4),
        "utilization": round(load.utilization, 4),
        "total_prefill_uncached_tokens": load.total_prefill_tokens,
        "total_prefill_busy_us": 0, "decode_moments": None,
        "num_total_reqs": load.num_running_reqs + load.num_waiting_reqs,
    }
    every = include is None or "all" in include
    if every or "memory" in include:
        entry["memory"] = {"weight_gb": round(load.weight_gb, 3),
                           "kv_cache_gb": round(load.kv_cache_gb, 3), "graph_gb": 0.0,
                           "token_capacity": load.max_total_num_tokens}
    if every or "disagg" in include:
        entry["disaggregation"] = {
            "mode": "null", "prefill_bootstrap_queue_reqs": 0, "prefill_prealloc_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
    if every or "queues" in include:
        entry["queues"] = {"waiting": load.num_waiting_reqs, "grammar": 0,
                           "paused": load.num_paused_reqs,
                           "retracted": load.num_retracted_reqs, "prealloc_ready": 0}
    return entry     # the speculative and LoRA sections are not reported (SGLang omits them)


def aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """0.5.9's ``aggregate`` over the ranks' entries."""
    n = len(loads)
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4) if n else 0.0,
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2) if n else 0.0,
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4) if n else 0.0,
    }


def prometheus_text(loads: list[dict[str, Any]]) -> str:
    """``?format=prometheus``: a gauge ``sglang_<key>`` per number, ``sglang_<section>_<key>``
    per number of a section (``spec`` / ``disagg`` for speculative / disaggregation)."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                for sub, sub_value in value.items():
                    if _is_number(sub_value):
                        name = f"sglang_{prefixes.get(key, key)}_{sub}"
                        samples.setdefault(name, []).append((rank, sub_value))
            elif _is_number(value):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _include(text: Optional[str]) -> Optional[set[str]]:
    if not text:
        return None
    include = {part.strip() for part in text.split(",")}
    bad = include - SECTIONS
    if bad:
        raise HTTPError(400, f"Invalid include sections: {sorted(bad)}. "
                             f"Valid options: {sorted(SECTIONS)}")
    return include


def _dp_rank(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise HTTPError(400, f"dp_rank: must be an integer, got {text!r}") from None


def add_load_routes(app: FastAPI, engine: Engine) -> None:
    tm = engine.tm

    async def current() -> list[LoadReport]:
        """One LoadReport per DP rank (a data-parallel engine answers with the list)."""
        r = await tm.async_call("get_load")
        if not r.success:
            raise HTTPError(r.status or 500, r.message)
        return r.result if isinstance(r.result, list) else [r.result]

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response([get_load_entry(x, i) for i, x in enumerate(await current())])

    @app.get("/v1/loads")
    async def v1_loads(request: Request) -> Response:
        query = request.query_params
        include, dp_rank = _include(query.get("include")), _dp_rank(query.get("dp_rank"))
        loads = [v1_load_entry(x, include, i) for i, x in enumerate(await current())]
        loads = [d for d in loads if dp_rank is None or d["dp_rank"] == dp_rank]
        if query.get("format") == "prometheus":
            return Response(prometheus_text(loads),
                            media_type="text/plain; version=0.0.4; charset=utf-8")
        device = engine.config.resolved_device()
        return json_response({
            "timestamp": datetime.now(UTC).isoformat(),
            "version": rollout_engine_version(), "dp_rank_count": len(loads),
            "accelerator": _accelerator_name(device), "num_accelerators": 1,
            "loads": loads, "aggregate": aggregate(loads)})


def _accelerator_name(device: Any) -> Optional[str]:
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(device)
