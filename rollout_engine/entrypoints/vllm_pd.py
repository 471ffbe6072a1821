"""vLLM's prefill-decode protocol (vllm-router's ``--vllm-pd-disaggregation``) over the
engine's own KV transfer.

The router sends a request first to the prefill server with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; that server answers as usual plus the
``kv_transfer_params`` the decode server needs (our bootstrap host, port and a room, in vLLM's
``remote_host`` / ``remote_port`` / ``remote_engine_id``). The router then sends the original
request to the decode server with those params (``do_remote_prefill``). The decode server
fetches the room's prompt KV as for SGLang's protocol, but computes the first token itself
(``Bootstrap.resample``): the prefill stage ran with the router's ``max_tokens`` /
``min_tokens``, not the caller's.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any, Optional

__all__ = ["kv_transfer_bootstrap", "kv_transfer_answer"]


def _advertised_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def kv_transfer_bootstrap(params: Optional[dict[str, Any]], config: Any
                          ) -> Optional[dict[str, Any]]:
    """The ``bootstrap`` (``RequestBuilder.build``) that vLLM's ``kv_transfer_params`` ask of
    this server, or None; ValueError naming the field when this server cannot honour them."""
    if not params:
        return None
    mode = config.disaggregation_mode
    if params.get("do_remote_decode"):
        if mode != "prefill":
            raise ValueError("kv_transfer_params: do_remote_decode needs a server started with "
                             f"--disaggregation-mode prefill (this one: {mode})")
        port = config.disaggregation_bootstrap_port
        if not port:
            raise ValueError("kv_transfer_params: a prefill server for vLLM's PD protocol needs "
                             "a fixed --disaggregation-bootstrap-port (not 0)")
        return {"host": _advertised_host(config.host), "port": port,
                "room": uuid.uuid4().hex}
    if params.get("do_remote_prefill"):
        if mode != "decode":
            raise ValueError("kv_transfer_params: do_remote_prefill needs a server started "
                             f"with --disaggregation-mode decode (this one: {mode})")
        host, port, room = (params.get(k) for k in ("remote_host", "remote_port",
                                                     "remote_engine_id"))
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) \
                or not isinstance(room, str) or not room:
            raise ValueError("kv_transfer_params: do_remote_prefill needs remote_host, "
                             "remote_port and remote_engine_id as this engine's prefill "
                             "server answers them")
        return {"host": host, "port": port, "room": room, "resample": True}
    return None


def kv_transfer_answer(bootstrap: Optional[dict[str, Any]], config: Any) -> dict[str, Any]:
    """The response's ``kv_transfer_params`` for a prefill stage (empty otherwise)."""
    if bootstrap is None or config.disaggregation_mode != "prefill" or \
            bootstrap.get("resample"):
        return {}
    return {"kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": bootstrap["room"], "remote_host": bootstrap["host"],
        "remote_port": bootstrap["port"], "remote_block_ids": [], "tp_size": 1}}
