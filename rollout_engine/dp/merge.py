"""One answer from N replicas' answers to a fanned-out control call, in the shape a caller of
one scheduler expects (so SGLang clients of ``/update_weights_*``, ``/get_weight_version``,
``/release_memory_occupation`` ... read it unchanged), with every replica's own answer kept.

    success     every replica succeeded; else the first failure (status and message,
                prefixed "dp rank i: "), the other replicas' answers still under dp_results
    dict result replica 0's, plus ``dp_results`` (each replica's dict), counters summed
                (``SUMMED``, and the ``stats`` / ``hicache`` tables /metrics reads), for
                get_server_info ``dp_internal_states``, and for weights_checker every
                replica's ``ranks`` one after another, each with its ``dp_rank`` and its
                global ``rank`` (``dp_rank * tp_size + tp_rank``, as SGLang numbers them)
    get_load    the list of every replica's LoadReport (the load routes list one per rank)
    other       (a WeightSlice, None) replica 0's: the replicas hold the same weights
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_engine.protocol.messages import ControlResult

__all__ = ["SUMMED", "merge_results"]

SUMMED = ("bytes_freed", "num_running_reqs", "num_waiting_reqs", "kv_free_tokens",
          "kv_cached_tokens")
"""Counters that mean "over the whole server" when added up."""


COUNTER_TABLES = ("stats", "hicache")
"""get_server_info's tables of counters (what /metrics reports): summed entry by entry."""


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _sum_table(tables: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(tables[0])
    for key, value in merged.items():
        if _number(value) and all(_number(t.get(key)) for t in tables):
            merged[key] = sum(t[key] for t in tables)
    return merged


def _merge_dicts(method: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(results[0])
    for key in SUMMED:
        if all(isinstance(r.get(key), int) for r in results):
            merged[key] = sum(r[key] for r in results)
    for key in COUNTER_TABLES:
        if all(isinstance(r.get(key), dict) for r in results):
            merged[key] = _sum_table([r[key] for r in results])
    if method == "get_server_info":
        merged["dp_internal_states"] = [r.get("internal_state") for r in results]
        merged["dp_size"] = len(results)
    if method == "weights_checker" and all(isinstance(r.get("ranks"), list) for r in results):
        merged["ranks"] = [_on_replica(entry, i, len(results))
                           for i, r in enumerate(results) for entry in r["ranks"]]
    merged["dp_results"] = list(results)
    return merged


def _on_replica(entry: dict[str, Any], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """A weights_checker rank entry of replica ``dp_rank`` (which numbered it as alone)."""
    infos = [{**info, "dp_rank": dp_rank, "dp_size": dp_size,
              "rank": dp_rank * info["tp_size"] + info["tp_rank"],
              "size": dp_size * info["tp_size"]} for info in entry["parallelism_info"]]
    return {**entry, "parallelism_info": infos}


def merge_results(call_id: int, method: str, parts: Sequence[ControlResult]) -> ControlResult:
    """`parts[i]`: replica i's answer to call `call_id`."""
    failed = [(i, p) for i, p in enumerate(parts) if not p.success]
    if failed:
        i, first = failed[0]
        others = [p.result for p in parts]
        return ControlResult(call_id, False, result={"dp_results": others},
                             message=f"dp rank {i}: {first.message}", status=first.status,
                             cancelled=all(p.cancelled for p in parts))
    results = [p.result for p in parts]
    if method == "get_load":
        merged: Any = results
    elif all(isinstance(r, dict) for r in results):
        merged = _merge_dicts(method, results)
    else:
        merged = results[0]
    return ControlResult(call_id, True, result=merged, message=parts[0].message,
                         status=parts[0].status)
