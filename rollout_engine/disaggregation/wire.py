"""The bootstrap connection's framing, and the record that travels with a request's KV.

One TCP connection per transfer, decode server -> prefill server's bootstrap port::

    decode:  header {"op": "fetch", "room", "layout", "boot_id", "shm", "wait_s"}
    prefill: header {"ok": true, "record", "nbytes", "shm_name"} then, without shm_name,
             nbytes of KV; or {"ok": false, "error"}
    decode:  header {"op": "done"} (after copying from shared memory), then closes

A header is a 4-byte big-endian length and that many bytes of JSON, at most ``MAX_HEADER``.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

MAX_HEADER = 64 * 1024 * 1024   # the record carries the prompt ids and top logprobs


class TransferError(RuntimeError):
    """A transfer that cannot complete: refused, cut off, timed out, or inconsistent."""


@dataclass
class FirstToken:
    """What the prefill server's forward produced besides the KV: the first output token and
    its records, and the weights it ran under (``weights``: see ``weight_tag``)."""

    input_ids: list[int]
    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[float, int]]] = None
    token_ids_logprobs: Optional[list[tuple[float, int]]] = None
    top_p_kept: Optional[list[int]] = None
    weight_version: str = "default"
    weights: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> FirstToken:
        if not isinstance(d, dict) or not isinstance(d.get("input_ids"), list) or \
                not isinstance(d.get("token"), int):
            raise TransferError("the prefill server's record is malformed")
        top = d.get("top_logprobs")
        chosen = d.get("token_ids_logprobs")
        return cls(input_ids=[int(t) for t in d["input_ids"]], token=int(d["token"]),
                   logprob=d.get("logprob"),
                   top_logprobs=None if top is None else [(float(a), int(b)) for a, b in top],
                   token_ids_logprobs=None if chosen is None else [
                       (float(a), int(b)) for a, b in chosen],
                   top_p_kept=d.get("top_p_kept"),
                   weight_version=str(d.get("weight_version", "default")),
                   weights=str(d.get("weights", "")), extra=dict(d.get("extra") or {}))


def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    body = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (TransferError if the peer closes first)."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise TransferError(f"the connection closed after {got} of {total} bytes")
        got += n


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    if length > MAX_HEADER:
        raise TransferError(f"a header of {length} bytes is over the {MAX_HEADER} limit")
    try:
        header = json.loads(recv_exact(sock, length))
    except ValueError as e:
        raise TransferError(f"a header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise TransferError("a header is not a JSON object")
    return header


def boot_id() -> str:
    """This machine's boot id: two processes that read the same one share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
