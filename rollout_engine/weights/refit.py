"""Weight refit in the scheduler process: from disk, from tensor handles, from a broadcast.

Each path ends in ``loader.load_weights`` (validate every name, shape and dtype, then copy), so
a bad update changes nothing. Process groups for broadcasts are built directly on a TCPStore, not
through ``init_process_group``, so the engine's own distributed state is never touched.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from rollout_engine.compat.payloads import named_tensors_from_sglang, read_refit_payload
from rollout_engine.protocol.bucket import FlattenedBucket, bucket_layout, str_to_dtype
from rollout_engine.weights.loader import LoadReport, iter_safetensors, load_weights

LOAD_FORMATS = (None, "direct", "flattened_bucket")


def refit_from_disk(model: nn.Module, model_path: str) -> LoadReport:
    return load_weights(model, list(iter_safetensors(model_path)), strict_dtype=False)


def named_tensors_from_payload(payload: Any, load_format: Optional[str]
                               ) -> list[tuple[str, torch.Tensor]]:
    """Turn a deserialized payload into (name, tensor) pairs, checking its declared format."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    sglang = named_tensors_from_sglang(payload, load_format)  # slime's {"flattened_tensor", ...}
    if sglang is not None:
        return sglang
    if load_format == "flattened_bucket":
        buckets = payload if isinstance(payload, list) else [payload]
        out: list[tuple[str, torch.Tensor]] = []
        for b in buckets:
            if not isinstance(b, FlattenedBucket):
                raise ValueError("flattened_bucket payload must hold FlattenedBucket objects")
            out.extend(b.named_tensors())
        return out
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor) for x in payload):
        raise ValueError("named tensors must be a list of (name, tensor) pairs")
    return [(n, t) for n, t in payload]


def refit_from_serialized(model: nn.Module, serialized: list[str], load_format: Optional[str]
                          ) -> LoadReport:
    if not isinstance(serialized, list) or not serialized:
        raise ValueError("serialized_named_tensors: must be a non-empty list of strings "
                         "(one per tensor-parallel rank)")
    # one rank here: rank 0's payload is ours
    payload = read_refit_payload(serialized[0], model)  # byte cap from the model's size
    return load_weights(model, named_tensors_from_payload(payload, load_format), strict_dtype=True)


@dataclass
class UpdateGroup:
    pg: Any
    rank: int
    world_size: int
    backend: str


class WeightUpdateGroups:
    """Named process groups whose rank 0 is the trainer and whose other ranks receive.

    Joining one is a rendezvous that waits for the trainer: ``start_init`` runs it in a helper
    thread (the scheduler keeps serving meanwhile) and ``finish_init``, called back in the
    scheduler thread once it is done, registers the group or raises its error.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: dict[str, UpdateGroup] = {}
        self.pending: dict[str, Future] = {}

    def start_init(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str, timeout_s: float
                   ) -> Future:
        """Validate, then start the rendezvous; the future yields the UpdateGroup."""
        if group_name in self.groups or group_name in self.pending:
            raise ValueError(f"group_name: {group_name!r} already exists (or is being joined); "
                             "destroy it first")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend: must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend: nccl needs CUDA; use gloo on CPU")
        if not isinstance(master_port, int) or isinstance(master_port, bool) \
                or not 0 < master_port < 65536:
            raise ValueError(f"master_port: must be a port number, got {master_port!r}")
        rank = rank_offset  # one rank per engine here (no tensor parallelism yet)
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset: engine rank {rank} must be in [1, {world_size})")
        future: Future = Future()
        self.pending[group_name] = future
        args = (future, master_address, master_port, rank, world_size, group_name, backend,
                timeout_s)
        threading.Thread(target=self._rendezvous, args=args, daemon=True,
                         name=f"weight-update-group-{group_name}").start()
        return future

    def finish_init(self, group_name: str, future: Future) -> None:
        """Register a finished rendezvous (scheduler thread); raises the rendezvous error."""
        self.pending.pop(group_name, None)
        self.groups[group_name] = future.result()

    def _rendezvous(self, future: Future, address: str, port: int, rank: int,
                    world_size: int, group_name: str, backend: str, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        where = f"{address}:{port}"
        try:
            try:
                store = dist.TCPStore(address, port, world_size, is_master=False,
                                      timeout=timeout)
            except RuntimeError as e:
                raise TimeoutError(
                    f"init_weights_update_group: the trainer (rank 0) did not open its TCPStore "
                    f"at {where} within {timeout_s:g} s (weight_update_group_timeout): start "
                    f"the trainer's side of group {group_name!r} at the same time "
                    f"({str(e).splitlines()[0]})") from None
            prefix = dist.PrefixStore(group_name, store)
            try:
                pg = (dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
                      if backend == "gloo" else dist.ProcessGroupNCCL(prefix, rank, world_size))
            except RuntimeError as e:
                raise TimeoutError(
                    f"init_weights_update_group: reached the trainer's store at {where}, but "
                    f"the {world_size} ranks of group {group_name!r} did not all join within "
                    f"{timeout_s:g} s; {_missing_ranks(prefix, rank, world_size)} "
                    f"({str(e).splitlines()[0]})") from None
            future.set_result(UpdateGroup(pg, rank, world_size, backend))
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            future.set_exception(e)

    def destroy(self, group_name: str) -> None:
        if group_name in self.pending:
            raise ValueError(f"group_name: {group_name!r} is still being joined; wait for "
                             "init_weights_update_group to return")
        if self.groups.pop(group_name, None) is None:
            raise ValueError(f"group_name: no weight update group {group_name!r}")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
        """Receive the trainer's broadcast (rank 0). Always drains the whole broadcast, even for
        a bad update, so the trainer never hangs; validation happens afterwards."""
        group = self.groups.get(group_name)
        if group is None:
            still = " yet (its init_weights_update_group has not returned)" \
                if group_name in self.pending else ""
            raise ValueError(f"group_name: no weight update group {group_name!r}{still}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format: must be None or 'flattened_bucket', got {load_format!r}")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        shapes_t = [tuple(int(d) for d in s) for s in shapes]
        if load_format == "flattened_bucket":
            metas, total = bucket_layout(names, dtypes, shapes_t)
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            group.pg.broadcast([buf], opts).wait()
            return FlattenedBucket(buf, metas).named_tensors()
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes_t):
            t = torch.empty(shape, dtype=str_to_dtype(dtype), device=self.device)
            group.pg.broadcast([t], opts).wait()
            out.append((name, t))
        return out


def _missing_ranks(prefix: Any, rank: int, world_size: int) -> str:
    """Which ranks never joined a gloo group, from the keys gloo's rendezvous writes
    (``<group seq>/<rank>``); a generic hint if this torch writes another layout."""
    try:
        joined = [r for r in range(world_size) if prefix.check([f"0/{r}"])]
    except RuntimeError:
        joined = []
    if rank not in joined:
        return "the trainer (rank 0) or another engine never created its side"
    missing = [r for r in range(world_size) if r not in joined]
    who = ", ".join("the trainer (rank 0)" if r == 0 else f"engine rank {r}" for r in missing)
    return f"missing: {who}"
