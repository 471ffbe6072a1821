"""The order in which `RolloutFleet` calls the servers of a prefill-decode (PD) pair.

Behind a PD router every request runs on a prefill server (prompt and first token) and then
on a decode server, which continues from the prefill's KV and refuses KV computed under other
weights than its own (the engine's weight tag: the version label and the number of loads
since start). So the fleet calls a pair's servers in phases:

- going down (``pause``, ``sleep``, ``update_weight_version``): every prefill server first,
  then the others. A prefill server that stops first stops producing KV; the rooms of the
  requests it aborts are failed at once, so the decode servers' requests waiting on them
  end instead of timing out; then the decode servers stop.
- coming up (``wake``, ``continue_generation``): the decode servers (and whole servers)
  first, then the prefill servers, so no KV is exported before its decode server can take it.
- ``refit``: one weight push gives every server the same calls, so both servers of a pair end
  on the same weight tag.

Each phase fans out in parallel; a phase starts when the one before it has answered (or timed
out). A server's role is its ``get_server_info()["disaggregation_mode"]``; an engine object
without ``get_server_info`` is a whole server ("null").
"""

from __future__ import annotations

from typing import Any

__all__ = ["DOWN", "UP", "phases", "role_of"]

DOWN = "down"
UP = "up"


def role_of(engine: Any) -> str:
    """``engine``'s disaggregation mode: "prefill", "decode" or "null"."""
    info = getattr(engine, "get_server_info", None)
    if info is None:
        return "null"
    mode = info().get("disaggregation_mode") or "null"
    return mode if mode in ("prefill", "decode") else "null"


def phases(roles: dict[int, str], direction: str) -> list[list[int]]:
    """The engine indices of ``roles`` in call order for ``direction`` (DOWN or UP): a list of
    phases, each called in parallel, empty phases left out."""
    if direction not in (DOWN, UP):
        raise ValueError(f"direction: must be {DOWN!r} or {UP!r}, got {direction!r}")
    prefill = [i for i, role in roles.items() if role == "prefill"]
    rest = [i for i, role in roles.items() if role != "prefill"]
    ordered = [prefill, rest] if direction == DOWN else [rest, prefill]
    return [phase for phase in ordered if phase]
