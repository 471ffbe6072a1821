"""Weight-update groups on the engine's side: joining the trainer's group (a rendezvous off
the loop), and receiving its broadcasts (``update_weights_from_distributed``).

A call's receives are posted at once and complete off the loop (`Receipt`); they land in a
reused staging slot of the group (`StagingBuffer`) or, for an unbucketed update the model takes
as announced, straight in spare parameter storage (``weights/shadow.py``). Groups are joined as
SGLang's engine joins them (same store keys, rank ``rank_offset + tp_rank``;
``protocol/weight_broadcast.py``), without touching the process's own torch.distributed state.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional

import torch

from rollout_engine.protocol.bucket import SUPPORTED_DTYPES, str_to_dtype
from rollout_engine.protocol.messages import BusyError
from rollout_engine.protocol.weight_broadcast import (
    GroupIncompleteError,
    StoreUnreachableError,
    UpdateGroup,
    flat_layout,
    join_update_group,
    unflatten,
)


def declared_dtype(name: Any) -> torch.dtype:
    """A dtype of ``update_weights_from_distributed``'s ``dtypes``: SGLang resolves
    ``getattr(torch, name)``, so "bfloat16", "torch.bfloat16" and aliases ("float", "half") all
    name one; a torch.dtype passes through (the Python Engine's callers)."""
    if isinstance(name, torch.dtype) and name in SUPPORTED_DTYPES:
        return name
    if isinstance(name, str):
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES:
            return dtype
    return str_to_dtype(name)   # raises, listing the supported names


class WeightUpdateGroups:
    """Named process groups whose rank 0 is the trainer and whose other ranks receive.

    Joining one is a rendezvous that waits for the trainer: ``start_init`` runs it in a helper
    thread (the scheduler keeps serving meanwhile) and ``finish_init``, called back in the
    scheduler thread once it is done, registers the group or raises its error.
    """

    def __init__(self, device: torch.device, tp_rank: int = 0) -> None:
        self.device = device
        self.tp_rank = tp_rank   # one rank per engine today (no tensor parallelism)
        self.groups: dict[str, UpdateGroup] = {}
        self.pending: dict[str, Future] = {}
        self.staging: dict[str, StagingBuffer] = {}   # reused receive buffers per group
        self.in_flight: list[Receipt] = []   # posted updates not yet applied or refused

    def start_init(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str, timeout_s: float
                   ) -> Future:
        """Validate, then start the rendezvous; the future yields the UpdateGroup."""
        if not isinstance(group_name, str) or not group_name:
            raise ValueError("group_name: must be a non-empty string")
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
        for field_name, value in (("rank_offset", rank_offset), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field_name}: must be an integer, got {value!r}")
        rank = rank_offset + self.tp_rank   # SGLang's rank assignment
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset: engine rank {rank} must be in [1, {world_size}) "
                             "(rank 0 is the trainer)")
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

    @staticmethod
    def _rendezvous(future: Future, address: str, port: int, rank: int, world_size: int,
                    group_name: str, backend: str, timeout_s: float) -> None:
        where = f"{address}:{port}"
        try:
            try:
                group = join_update_group(address, port, rank, world_size, group_name, backend,
                                          timeout_s)
            except StoreUnreachableError as e:
                raise TimeoutError(
                    f"init_weights_update_group: the trainer (rank 0) did not open its TCPStore "
                    f"at {where} within {timeout_s:g} s (weight_update_group_timeout): start "
                    f"the trainer's side of group {group_name!r} at the same time ({e})"
                ) from None
            except GroupIncompleteError as e:
                raise TimeoutError(
                    f"init_weights_update_group: reached the trainer's store at {where}, but "
                    f"{e}; {_who_is_missing(e.missing, rank)}") from None
            future.set_result(group)
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            future.set_exception(e)

    def destroy(self, group_name: str) -> None:
        if self.in_flight:
            raise BusyError("a weight update is being received; wait for its answer before "
                            "destroying the group")
        if group_name in self.pending:
            raise ValueError(f"group_name: {group_name!r} is still being joined; wait for "
                             "init_weights_update_group to return")
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"group_name: no weight update group {group_name!r}")
        self.staging.pop(group_name, None)
        group.shutdown()

    def release_buffers(self) -> None:
        """Free every group's receive buffers (the weights are being released); the next
        update allocates them again (a slot an update is receiving into stays)."""
        for staging in self.staging.values():
            staging.release()

    def receive(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                group_name: str, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
        """`post` and wait: the received (name, tensor) pairs (views into the group's staging
        buffer, valid until the next update on that group)."""
        receipt = self.post(names, dtypes, shapes, group_name, load_format)
        try:
            return receipt.wait()
        finally:
            self.settle(receipt)

    def post(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
             group_name: str, load_format: Optional[str],
             after: Optional[Receipt] = None,
             into: Optional[list[torch.Tensor]] = None) -> Receipt:
        """Post the receives of the trainer's broadcast (rank 0) in the dtypes it declares
        (load_weights casts floating ones afterwards) and return at once: the `Receipt`'s
        future completes once every byte has arrived (after `after`'s, so updates complete in
        the order they were posted). The scheduler keeps running meanwhile, and posts the
        next update's receives while this one is applied (that is the pipeline). The whole
        broadcast is always drained, even for an update refused afterwards, so the trainer
        never hangs; only a malformed announcement (no byte count) is refused before.
        ``into``: per-tensor receives (``load_format`` None) land in these tensors, one per
        name, instead of a staging slot (`ShadowWeights`)."""
        group = self.groups.get(group_name)
        if group is None:
            still = " yet (its init_weights_update_group has not returned)" \
                if group_name in self.pending else ""
            raise ValueError(f"group_name: no weight update group {group_name!r}{still}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format: must be None or 'flattened_bucket', got {load_format!r}")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have the same length, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        torch_dtypes = [declared_dtype(d) for d in dtypes]
        shapes_t = [tuple(int(d) for d in s) for s in shapes]
        for name, shape in zip(names, shapes_t):
            if any(d < 0 for d in shape):
                raise ValueError(f"shapes: weight {name!r} has a negative dimension {shape}")
        if into is not None:
            if load_format is not None or len(into) != len(names) or any(
                    tuple(t.shape) != shape or t.dtype != dtype
                    for t, dtype, shape in zip(into, torch_dtypes, shapes_t)):
                raise ValueError("into: one tensor of each announced shape and dtype")
            works = [group.broadcast(t) for t in into]
            named_into = list(zip(names, into))
            receipt = Receipt(lambda: named_into, works, None, self.device, after)
            self.in_flight.append(receipt)
            return receipt
        staging = self.staging.setdefault(group_name, StagingBuffer(self.device))
        if load_format == "flattened_bucket":   # SGLang's bucket: bytes back to back
            _, nbytes = flat_layout(torch_dtypes, shapes_t)
            slot = staging.take(nbytes)
            buf = staging.buffer(slot)[:nbytes]
            works = [group.broadcast(buf)]

            def unpack() -> list[tuple[str, torch.Tensor]]:
                # after the broadcast landed: a piece its dtype cannot be viewed at is a copy
                return list(zip(names, unflatten(buf, torch_dtypes, shapes_t)))
        else:
            # one broadcast per tensor, all posted at once (as SGLang does), each received
            # into its own aligned slice of the reused buffer
            offsets, nbytes = aligned_layout(torch_dtypes, shapes_t)
            slot = staging.take(nbytes)
            buf = staging.buffer(slot)
            named, works = [], []
            for name, dtype, shape, (start, end) in zip(names, torch_dtypes, shapes_t, offsets):
                t = buf[start:end].view(dtype).view(shape)
                works.append(group.broadcast(t))
                named.append((name, t))
            unpack = named.copy
        receipt = Receipt(unpack, works, lambda: staging.give(slot), self.device, after)
        self.in_flight.append(receipt)
        return receipt

    def settle(self, receipt: Receipt) -> None:
        """Forget a receipt whose update was applied or refused (its slot is free again)."""
        receipt.done()
        if receipt in self.in_flight:
            self.in_flight.remove(receipt)

    def buffer_bytes(self) -> int:
        """Bytes held by every group's staging slots."""
        return sum(staging.num_bytes for staging in self.staging.values())

    def receiving(self) -> int:
        """Updates posted and not yet settled."""
        return len(self.in_flight)


class Receipt:
    """One ``update_weights_from_distributed`` call's broadcast being received into a staging
    slot. A waiter thread completes `future` (with the (name, tensor) pairs `unpack` makes of
    the received bytes, or the receive's error) once every byte arrived and `after` completed;
    `unpack` never runs before that, so no copy it takes can miss a byte. `done` frees the
    slot."""

    def __init__(self, unpack: Callable[[], list[tuple[str, torch.Tensor]]], works: list[Any],
                 free: Any, device: torch.device, after: Optional[Receipt]) -> None:
        self.unpack, self.works = unpack, works
        self._free: Any = free
        self.future: Future = Future()
        threading.Thread(target=self._wait_all, args=(device, after), daemon=True,
                         name="weight-update-receive").start()

    def _wait_all(self, device: torch.device, after: Optional[Receipt]) -> None:
        try:
            for work in self.works:
                work.wait()   # the group's timeout bounds each (a dead trainer raises)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            named = self.unpack()
            if after is not None:
                after.future.exception()   # in order: an earlier update is applied first
            self.future.set_result(named)
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            self.future.set_exception(e)

    def wait(self) -> list[tuple[str, torch.Tensor]]:
        return self.future.result()

    def done(self) -> None:
        if self._free is not None:
            self._free()
            self._free = None


class StagingBuffer:
    """A weight-update group's receive buffers ("slots"), allocated once and reused by every
    update (grown when one needs more, never shrunk): a broadcast lands in a slot, is
    validated, and only then copied into the parameters, so a broadcast cut off halfway (the
    trainer died, a size mismatch) leaves the weights untouched. Reuse also spares each refit
    the page faults of fresh memory. Updates in flight at once (received while an earlier one
    is applied) take different slots; a pipelined trainer keeps two busy."""

    MAX_SLOTS = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[Optional[torch.Tensor]] = []
        self.busy: set[int] = set()

    def take(self, num_bytes: int) -> int:
        """A free slot holding at least `num_bytes` (grown or added if needed)."""
        free = [i for i in range(len(self.slots)) if i not in self.busy]
        if not free:
            if len(self.slots) >= self.MAX_SLOTS:
                raise BusyError(f"{len(self.busy)} weight updates of this group are still "
                                "being received or applied; wait for their answers")
            self.slots.append(None)
            free = [len(self.slots) - 1]
        fits = [i for i in free if self._size(i) >= num_bytes]
        index = fits[0] if fits else free[0]
        if self._size(index) < num_bytes:
            self.slots[index] = None   # free the small one first
            self.slots[index] = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        self.busy.add(index)
        return index

    def buffer(self, index: int) -> torch.Tensor:
        buf = self.slots[index]
        assert buf is not None
        return buf

    def give(self, index: int) -> None:
        self.busy.discard(index)

    def _size(self, index: int) -> int:
        buf = self.slots[index]
        return 0 if buf is None else buf.numel()

    @property
    def num_bytes(self) -> int:
        return sum(self._size(i) for i in range(len(self.slots)))

    def release(self) -> None:
        """Free the slots no update is using."""
        for i in range(len(self.slots)):
            if i not in self.busy:
                self.slots[i] = None


STAGING_ALIGN = 64
"""Per-tensor receives start at multiples of this (any dtype can be viewed there)."""


def aligned_layout(dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]
                   ) -> tuple[list[tuple[int, int]], int]:
    """Byte ranges of tensors laid out one after another at `STAGING_ALIGN`-aligned offsets,
    and the total size."""
    ranges, used = [], 0
    for dtype, shape in zip(dtypes, shapes):
        start = -(-used // STAGING_ALIGN) * STAGING_ALIGN
        end = start + math.prod(shape) * dtype.itemsize
        ranges.append((start, end))
        used = end
    return ranges, used


def _who_is_missing(missing: list[int], rank: int) -> str:
    if not missing or missing == [rank]:
        return "the trainer (rank 0) or another engine never created its side"
    who = ", ".join("the trainer (rank 0)" if r == 0 else f"engine rank {r}" for r in missing)
    note = ""
    if 0 in missing and len(missing) > 1:
        note = (" (a trainer joining the SGLang way waits until every rank has connected "
                "before building its side, so a missing engine holds it back)")
    return f"missing: {who}{note}"
