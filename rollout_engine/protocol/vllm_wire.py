"""vLLM's native weight transfer on the wire: the init and update payloads, and the packed layout.

A trainer speaking vLLM's protocol (its ``NCCLTrainerWeightTransferEngine``, SkyRL's broadcast
sender) drives four calls:

    init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
                                 world_size, packed?, packed_buffer_size_bytes?,
                                 packed_num_buffers?}}       join the group (trainer = rank 0)
    start_weight_update                                      open a session
    update_weights {"update_info": {names, dtype_names, shapes[, packed, ...]}}   (1+ times)
    finish_weight_update {"weight_version"?}                 the session's weights take effect

Each ``update_weights`` is matched by broadcasts from rank 0, in the order of ``names``:

    per tensor: one broadcast per tensor, of its shape and dtype
    packed:     the tensors' bytes back to back, cut into chunks: a chunk takes tensors until
                its size EXCEEDS ``packed_buffer_size_bytes`` (the tensor that crosses the
                limit is the chunk's last), one uint8 broadcast per chunk

        sizes 4, 4, 4, 4 B, buffer 6 B   ->   chunks [a, b] (8 B) [c, d] (8 B)

``packed`` and the buffer size are agreed at init (``init_info``); an ``update_info`` may carry
``packed`` / ``packed_buffer_size_bytes`` too (older vLLM trainers and SkyRL put them there),
which then wins for that call. ``packed_num_buffers`` only sets how many chunks a CUDA sender
keeps in flight: it does not change what is on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.protocol.bucket import SUPPORTED_DTYPES

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "TransferInit",
    "TransferUpdate",
    "dtype_name",
    "packed_chunks",
    "parse_init_info",
    "parse_update_info",
    "tensor_list",
    "worker_entry",
]

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30   # vLLM's defaults (1 GiB, double buffered)
DEFAULT_PACKED_NUM_BUFFERS = 2

INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size",
               "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes",
               "packed_num_buffers")
UPDATE_FIELDS = ("names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
                 "packed_num_buffers", "is_checkpoint_format")


@dataclass(frozen=True)
class TransferInit:
    """A checked ``init_info``: where the trainer's store listens, this engine's first rank in
    the group, and the wire parameters of every update."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


@dataclass(frozen=True)
class TransferUpdate:
    """A checked ``update_info``: the tensors one ``update_weights`` call receives, in wire
    order; ``packed`` / ``packed_buffer_size_bytes`` None: the init's."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    packed: Optional[bool] = None
    packed_buffer_size_bytes: Optional[int] = None

    def num_bytes(self) -> list[int]:
        return [math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes)]


def _unknown(body: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; vLLM's fields are {list(known)}")


def _int(value: Any, name: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be true or false, got {value!r}")
    return value


def parse_init_info(info: Any) -> TransferInit:
    """Check an ``init_info`` object (ValueError naming the field)."""
    if not isinstance(info, dict):
        raise ValueError(f"init_info: must be an object, got {type(info).__name__}")
    _unknown(info, INIT_FIELDS, "init_info")
    if info.get("nccl_unique_id_b64") is not None:
        raise ValueError("init_info.nccl_unique_id_b64: the unique-id rendezvous is not "
                         "supported; give master_address and master_port")
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size")
               if info.get(k) is None]
    if missing:
        raise ValueError(f"init_info: missing field(s) {missing}")
    address = info["master_address"]
    if not isinstance(address, str) or not address:
        raise ValueError(f"init_info.master_address: must be a host name, got {address!r}")
    port = _int(info["master_port"], "init_info.master_port", 1)
    if port > 65535:
        raise ValueError(f"init_info.master_port: must be a port number, got {port}")
    return TransferInit(
        address, port, _int(info["rank_offset"], "init_info.rank_offset", 1),
        _int(info["world_size"], "init_info.world_size", 2),
        _bool(info.get("packed", False), "init_info.packed"),
        _int(info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES),
             "init_info.packed_buffer_size_bytes", 1),
        _int(info.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS),
             "init_info.packed_num_buffers", 1))


def torch_dtype(name: Any, where: str) -> torch.dtype:
    """The dtype vLLM's receiver resolves (``getattr(torch, name)``), among those we load."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
        supported = sorted(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{where}: {name!r} is not a dtype name this engine receives "
                         f"({supported})")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name a sender puts in ``dtype_names`` ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


def worker_entry(info: Any, worker_rank: int = 0) -> dict[str, Any]:
    """An ``update_info``: an object, or a list of them indexed by worker rank (vLLM's per-rank
    form; ``worker_rank`` picks this engine's). ValueError unless an object is found."""
    if isinstance(info, list):
        if not 0 <= worker_rank < len(info):
            raise ValueError(f"update_info: a list needs an entry for worker rank {worker_rank}, "
                             f"got {len(info)}")
        info = info[worker_rank]
    if not isinstance(info, dict):
        raise ValueError(f"update_info: must be an object, got {type(info).__name__}")
    return info


def tensor_list(info: Mapping[str, Any]
                ) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
    """An ``update_info``'s ``names``, ``dtype_names`` and ``shapes``, checked (every
    backend's): equal-length lists of non-empty names, dtype names and shapes."""
    missing = [k for k in ("names", "dtype_names", "shapes") if info.get(k) is None]
    if missing:
        raise ValueError(f"update_info: missing field(s) {missing}")
    names, dtype_names, shapes = info["names"], info["dtype_names"], info["shapes"]
    for key, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, list):
            raise ValueError(f"update_info.{key}: must be a list, got {type(value).__name__}")
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"update_info: names, dtype_names and shapes must have the same length, "
                         f"got {len(names)}, {len(dtype_names)} and {len(shapes)}")
    checked_shapes = []
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"update_info.names[{i}]: must be a non-empty string, got {name!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"update_info.shapes[{i}] ({name!r}): must be a list of "
                             f"non-negative integers, got {shape!r}")
        checked_shapes.append(tuple(shape))
    dtypes = [torch_dtype(d, f"update_info.dtype_names[{i}] ({n!r})")
              for i, (n, d) in enumerate(zip(names, dtype_names))]
    return list(names), dtypes, checked_shapes


def parse_update_info(info: Any, worker_rank: int = 0) -> TransferUpdate:
    """Check an ``update_info`` of the broadcast backends (``worker_entry``'s forms).
    ValueError naming the field."""
    info = worker_entry(info, worker_rank)
    _unknown(info, UPDATE_FIELDS, "update_info")
    names, dtypes, shapes = tensor_list(info)
    packed = info.get("packed")
    size = info.get("packed_buffer_size_bytes")
    if info.get("is_checkpoint_format") is not None:
        _bool(info["is_checkpoint_format"], "update_info.is_checkpoint_format")
    if info.get("packed_num_buffers") is not None:
        _int(info["packed_num_buffers"], "update_info.packed_num_buffers", 1)
    return TransferUpdate(
        names, dtypes, shapes,
        None if packed is None else _bool(packed, "update_info.packed"),
        None if size is None else _int(size, "update_info.packed_buffer_size_bytes", 1))


def packed_chunks(num_bytes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """The tensors (index ranges) of each packed broadcast: a chunk takes tensors until its
    size exceeds ``buffer_size_bytes``; the last chunk takes what is left."""
    chunks: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(num_bytes):
        used += n
        if used > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, used = i + 1, 0
    if start < len(num_bytes):
        chunks.append(range(start, len(num_bytes)))
    return chunks
