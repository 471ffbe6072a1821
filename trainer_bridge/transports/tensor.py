"""Colocated refit: tensors travel as handles (CUDA IPC on GPU, shared memory on CPU) through
`engine.update_weights_from_tensor`; the engine copies from the trainer's memory directly.

    bucket_bytes=None:  one call, every (name, tensor) as its own handle   (load_format None)
    bucket_bytes=B, CPU: groups of <= B bytes, one call per group, every tensor its own handle
                        (load_format None)
    bucket_bytes=B, CUDA (or pack=True): pack into flat buckets of <= B bytes, one call per
                        bucket, one handle per call                   ("flattened_bucket")

CPU tensors are moved into shared memory *in place* by the serializer (as
`Tensor.share_memory_()` does): the trainer's parameters keep their values and stay usable, and
the engine copies straight from them. Packing them would copy every byte once more on a
memory-bound machine (bucketed refits measured 1.4-1.8x slower than unbucketed), for what CPU
handles do not need: opening one is a file lookup the engine caches, not a CUDA IPC import.
So on CPU a bucket is a bounded group of handles, as cheap as one call with all of them.
Packed buckets (CUDA, where each IPC handle costs an import; or `pack=True`) cost one extra copy
on the trainer side and far fewer handles (one per bucket). They are packed into two persistent
buffers per device (`BucketBuffers`; on CPU born in shared memory, so the serializer sends them
as they are), pipelined:

    trainer:  pack 0 -> slot 0 | call 0, pack 1 -> slot 1 | call 1, wait call 0, pack 2 -> slot 0
    engines:                   | apply call 0 (slot 0)    | apply call 1 (slot 1) | apply 2 ...

Two calls are outstanding (`MAX_IN_FLIGHT`), so an engine finds the next bucket queued when it
has applied one. A slot is refilled only after the engine call that read it has returned
(engines copy out of the buffer during the call), so reuse never shows an engine half-written
or stale bytes. Unpacked handle groups are pipelined the same way, up to
`MAX_IN_FLIGHT_GROUPS` deep (they hold no buffer). A
tensor bigger than `bucket_bytes` (a bucket of its own) is not packed: its bucket is its own
bytes, sent as the unbucketed path sends them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any, Optional

import torch

from rollout_engine.protocol.bucket import BucketPlan, FlattenedBucket, plan_buckets
from trainer_bridge.bucketing import nbytes
from trainer_bridge.transports.base import (
    WeightTransport,
    call_all,
    pipeline_depth,
    start_call,
    step_version,
    waited,
)

__all__ = ["BucketBuffers", "TensorTransport", "handle_groups"]

MAX_IN_FLIGHT = 2
"""Packed bucket calls outstanding per sync (one per reusable buffer): an engine finds bucket
k+1 queued when it has applied k."""

MAX_IN_FLIGHT_GROUPS = 8
"""Calls of handle groups outstanding per sync: they hold no buffer of the trainer's, so more
may wait in the engine's queue, which then never idles while the trainer hears an answer and
sends the next call (a call's answer takes a few thread hand-offs to reach the trainer)."""


def shared_buffer(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A bucket buffer; on CPU born in POSIX shared memory (file-name handle), which the
    serializer then sends as is instead of copying the packed bucket into a new shm segment."""
    if device.type != "cpu" or num_bytes == 0:
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(num_bytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (num_bytes,), (1,))


class BucketBuffers:
    """`NUM_SLOTS` reusable bucket buffers per device, kept from sync to sync.

    A slot is allocated on first use at the size of the largest bucket it must hold (grown only
    if a later sync needs more) and lives until `release`. The caller must not refill a slot
    while an engine may still read it.
    """

    NUM_SLOTS = 2

    def __init__(self, allocate: Callable[[int, torch.device], torch.Tensor] = shared_buffer
                 ) -> None:
        self.allocate = allocate   # (num_bytes, device) -> a 1-D uint8 buffer
        self._slots: dict[tuple[torch.device, int], torch.Tensor] = {}

    def slot(self, index: int, num_bytes: int, device: torch.device) -> torch.Tensor:
        """Slot `index % NUM_SLOTS` on `device`, at least `num_bytes` long (1-D uint8)."""
        key = (device, index % self.NUM_SLOTS)
        buffer = self._slots.get(key)
        if buffer is None or buffer.numel() < num_bytes:
            self._slots.pop(key, None)  # free the small one before allocating its successor
            buffer = self._slots[key] = self.allocate(num_bytes, device)
        return buffer

    @property
    def num_bytes(self) -> int:
        """Bytes held by all slots."""
        return sum(b.numel() for b in self._slots.values())

    def buffers(self) -> list[torch.Tensor]:
        """The slots allocated now (for inspection: tests check they are reused and freed)."""
        return list(self._slots.values())

    def release(self) -> None:
        """Drop every slot; its CPU shared memory is unlinked (an engine that still maps one
        keeps only its memory, until it lets go)."""
        self._slots.clear()


class TensorTransport(WeightTransport):
    """Each call goes to all engines at once (a thread per engine). Buckets are pipelined
    (module docstring): two calls outstanding, bucket k+1 packed (into the slot whose last
    reader has returned) while the engines apply bucket k."""

    name = "tensor"

    def __init__(self, bucket_bytes: Optional[int] = None, timeout_s: Optional[float] = None,
                 pack: Optional[bool] = None) -> None:
        """pack: buckets as flattened bytes (True), as groups of handles (False), or (None)
        packed only when a tensor is on a GPU (module docstring)."""
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes: must be a positive int or None, got {bucket_bytes!r}")
        if pack not in (None, True, False):
            raise ValueError(f"pack: must be None, True or False, got {pack!r}")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.pack = pack
        self.buffers = BucketBuffers()

    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: str) -> int:
        tensors = list(named_tensors)
        if self.bucket_bytes is None:
            call_all(self._start(engines, tensors, None, version, True), self.timeout_s)
            return nbytes(tensors)
        packs = self.pack if self.pack is not None else any(t.is_cuda for _, t in tensors)
        if not packs:   # handles into the trainer's own memory: nothing is reused
            groups = handle_groups(tensors, self.bucket_bytes)
            self._pipeline(lambda index, group: group, groups, None, engines, version,
                           max_in_flight=MAX_IN_FLIGHT_GROUPS)
            return nbytes(tensors)
        plans = self.plan(tensors)
        own = [_as_own_bucket(p, self.bucket_bytes) for p in plans]
        # each slot is sized once for every bucket it packs
        slot_bytes = _largest_by_device([p for p, o in zip(plans, own) if o is None])
        slot_reader: dict[int, list[Future[Any]]] = {}   # slot -> the call that last read it
        num_packed = [0]

        def fill(index: int, plan: BucketPlan) -> FlattenedBucket:
            bucket = own[index]
            if bucket is not None:
                return bucket
            slot = num_packed[0] % BucketBuffers.NUM_SLOTS
            if slot in slot_reader:   # engines copy out during the call: refill after it
                call_all(slot_reader.pop(slot), self.timeout_s)
            num_packed[0] += 1
            return plan.fill(self.buffers.slot(slot, slot_bytes[plan.device], plan.device))

        def started(index: int, calls: list[Future[Any]]) -> None:
            if own[index] is None:
                slot_reader[(num_packed[0] - 1) % BucketBuffers.NUM_SLOTS] = calls

        self._pipeline(fill, plans, "flattened_bucket", engines, version, started)
        return sum(plan.num_bytes for plan in plans)

    def _pipeline(self, payload_of: Callable[[int, Any], Any], buckets: Sequence[Any],
                  load_format: Optional[str], engines: Sequence[Any], version: str,
                  started: Optional[Callable[[int, list[Future[Any]]], None]] = None,
                  max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """One call per bucket, `max_in_flight` outstanding: each engine takes bucket k+1 from
        its queue as soon as it has applied bucket k (no round trip between them), while the
        trainer prepares the one after. Calls of one engine run in the order sent."""
        in_flight: list[list[Future[Any]]] = []
        depth = pipeline_depth(engines, max_in_flight)
        try:
            for index, bucket in enumerate(buckets):
                payload = payload_of(index, bucket)
                if len(in_flight) >= depth:
                    call_all(in_flight.pop(0), self.timeout_s)
                last = index == len(buckets) - 1
                calls = self._start(engines, payload, load_format,
                                    version if last else step_version(version, index), last)
                in_flight.append(calls)
                if started is not None:
                    started(index, calls)
            while in_flight:
                call_all(in_flight.pop(0), self.timeout_s)
        except BaseException:
            pending = [f for calls in in_flight for f in calls]
            _, still_running = wait(waited(pending), timeout=self.timeout_s)
            if still_running:  # an engine may still read the buffers: never refill them
                self.buffers.release()
            raise

    def plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[BucketPlan]:
        """The buckets `push` sends for `named_tensors` (one engine call each)."""
        if self.bucket_bytes is None:
            raise ValueError("plan: this transport sends tensors unbucketed (bucket_bytes None)")
        return list(plan_buckets(named_tensors, self.bucket_bytes))

    def close(self, engines: Sequence[Any]) -> None:
        self.buffers.release()

    def _start(self, engines: Sequence[Any], payload: Any, load_format: Optional[str],
               version: str, last: bool) -> list[Future[Any]]:
        # each engine gets its own serialization: a handle carries one reference per receiver
        return [start_call(e, "update_weights_from_tensor", payload,
                           load_format=load_format, flush_cache=last, weight_version=version)
                for e in engines]


def handle_groups(named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
                  ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_bytes` together (a bigger tensor alone)."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named_tensors:
        b = tensor.numel() * tensor.element_size()
        if not groups or size + b > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += b
    return groups


def _as_own_bucket(plan: BucketPlan, bucket_bytes: int) -> Optional[FlattenedBucket]:
    """A tensor larger than `bucket_bytes` (a bucket of its own) sent over its own bytes, as
    the unbucketed path sends it (moved into shared memory in place on CPU): packing it would
    copy every byte once more. None when the plan must be packed."""
    if len(plan.entries) != 1 or plan.num_bytes <= bucket_bytes:
        return None
    meta, tensor = plan.entries[0]
    if not tensor.is_contiguous():
        return None
    return FlattenedBucket(tensor.reshape(-1).view(torch.uint8), (meta,))


def _largest_by_device(plans: list[BucketPlan]) -> dict[torch.device, int]:
    """Bytes of the largest bucket on each device."""
    out: dict[torch.device, int] = {}
    for plan in plans:
        out[plan.device] = max(out.get(plan.device, 0), plan.num_bytes)
    return out
