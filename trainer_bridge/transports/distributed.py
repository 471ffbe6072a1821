"""Disaggregated refit: the trainer broadcasts (gloo on CPU, NCCL on GPU) to engines that
joined a weight-update group with it, exactly as SGLang's engine and slime's trainer do.

    trainer (rank 0)                          engine i (rank i + 1; with --dp-size, one rank
                                              per replica: `rank_offsets`)
    join_update_group(addr, port, 0, N + 1)   init_weights_update_group(addr, port, i + 1, N + 1)
      = rendezvous + PrefixStore(group_name)    -> the same store keys on the engine's side
        + torch's group helper's keys          (rollout_engine.protocol.weight_broadcast)
    per call:  broadcast(bucket or tensors) <-> update_weights_from_distributed(names, dtypes,
                                                shapes, load_format) -> receive, validate, load

So an SGLang server joins a group made here, and an engine of ours joins slime's. Both ends
block until all ranks take part, so every engine call runs in its own thread while the trainer
side runs here. Without `bucket_bytes`, one call announces every tensor (names, dtypes and
shapes once) and each tensor is its own broadcast straight from the trainer's memory (SGLang's
`load_format=None`). With it, runs of tensors of at most `bucket_bytes` are one engine call
each. On NCCL (or ``pack=True``) a run is packed back to back (SGLang's `FlattenedTensorBucket`
layout, which the engine recomputes from names, dtypes and shapes) and sent as one broadcast,
pipelined over two reused send buffers with two calls outstanding (`MAX_IN_FLIGHT`):

    trainer:  pack 0 -> A | call 0, pack 1 -> B | call 1, wait sent 0, pack 2 -> A | ...
    engine:               | receive 0           | receive 1, apply 0 | receive 2, apply 1 ...

On gloo a run is a call of per-tensor broadcasts (``pack=False``, the CPU default): packing
copies every byte once more on the trainer and once more on the engine, which cannot hide
under a loopback transfer that keeps both cores busy (packed buckets measured 1.1-1.4x slower
than unbucketed on a 2-core EPYC), while per-tensor receives land straight in the engine's
spare parameter storage. The bucket still bounds what one call carries.

Our engine posts a call's receives as soon as the call arrives and applies it once it has all
of it, while the next call is being received (an engine that handles one call at a time, as
SGLang's does, still works: the second call waits in its queue). Two calls are outstanding only
with engines that take calls in the order sent (``send_call``: `Engine`, `RayEngine`); over HTTP
each call waits for the previous answer. A tensor bigger than a bucket
is broadcast as it is (packing it would only copy it). The engine receives each call into a
reused buffer and copies it into its parameters only once the whole call has arrived, so a
broadcast cut off halfway changes no weight.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.protocol.bucket import dtype_to_str
from rollout_engine.protocol.weight_broadcast import (
    GroupIncompleteError,
    UpdateGroup,
    join_update_group,
)
from trainer_bridge.transports.base import (
    WeightSyncError,
    WeightTransport,
    call_all,
    checked,
    pipeline_depth,
    spawn,
    start_call,
    step_version,
)
from trainer_bridge.transports.bucket_runs import bucket_runs, own_bytes, pack_run, run_bytes
from trainer_bridge.transports.group_ranks import free_port, rank_offsets, rank_owner
from trainer_bridge.transports.tensor import BucketBuffers

__all__ = ["DistributedTransport"]


def _plain_buffer(num_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class DistributedTransport(WeightTransport):
    """Rank 0 of a weight-update group; `setup` (= `init_group`) must precede `push`."""

    name = "distributed"

    def __init__(self, master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 backend: str = "gloo", bucket_bytes: Optional[int] = None,
                 group_name: str = "weight_update_group", timeout_s: float = 120.0,
                 pack: Optional[bool] = None) -> None:
        """pack: a bucket as one flattened broadcast (True), as a call of per-tensor
        broadcasts (False), or (None) flattened only on NCCL (module docstring)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: nccl needs CUDA; use gloo on CPU")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes: must be a positive int or None, got {bucket_bytes!r}")
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        if pack not in (None, True, False):
            raise ValueError(f"pack: must be None, True or False, got {pack!r}")
        self.bucket_bytes = bucket_bytes
        self.pack = pack
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        self.port: Optional[int] = None  # the group's port (master_port, or a free one)
        self.group: Optional[UpdateGroup] = None
        self.world_size = 0
        self.num_engines = 0
        self.broken: Optional[str] = None
        # two send buffers, filled in turn: bucket k+1 is packed while bucket k is in flight
        self.buffers = BucketBuffers(allocate=_plain_buffer)

    # -- group -----------------------------------------------------------------------------------
    def setup(self, engines: Sequence[Any]) -> None:
        self.init_group(engines)

    def init_group(self, engines: Sequence[Any]) -> None:
        """Form the group: trainer rank 0, then each engine's ranks (one per data-parallel
        replica; world size 1 + all of them).
        Each engine's `init_weights_update_group` blocks until all ranks have joined, so they
        run concurrently with the trainer's own join; any engine's failure is raised at once."""
        if self.group is not None:
            raise ValueError(f"group_name: {self.group_name!r} is already initialized")
        if not engines:
            raise ValueError("engines: need at least one engine")
        port = self.master_port if self.master_port is not None else free_port(
            self.master_address)
        offsets = rank_offsets(engines)
        world_size = offsets[-1]
        joins = [spawn(checked, e, "init_weights_update_group", self.master_address, port,
                       offsets[i], world_size, group_name=self.group_name, backend=self.backend)
                 for i, e in enumerate(engines)]
        own = spawn(join_update_group, self.master_address, port, 0, world_size,
                    self.group_name, self.backend, self.timeout_s)
        # on failure, engines still waiting give up at their own timeout, and the trainer's
        # half-made group (and its store) dies with its thread
        try:
            self.group = call_all([*joins, own], self.timeout_s)[-1]
        except GroupIncompleteError as e:
            engines_missing = [f"engine {rank_owner(offsets, r)} (rank {r})" for r in e.missing
                               if r > 0]
            raise WeightSyncError(f"{e}; never joined: {', '.join(engines_missing) or '?'}"
                                  ) from None
        self.port, self.world_size, self.num_engines = port, world_size, len(engines)

    def close(self, engines: Sequence[Any]) -> None:
        """Destroy the group on every engine, then drop the trainer's side."""
        if self.group is None:
            return
        errors = []
        for e in engines:
            try:
                checked(e, "destroy_weights_update_group", self.group_name)
            except Exception as exc:  # noqa: BLE001 - tear down the rest anyway
                errors.append(exc)
        self.group.shutdown()
        self.group, self.port, self.world_size = None, None, 0
        self.broken = None
        self.buffers.release()
        if errors:
            raise errors[0]

    # -- push ------------------------------------------------------------------------------------
    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: str) -> int:
        if self.group is None:
            raise WeightSyncError("no weight-update group: call init_group(engines) first")
        if self.broken:
            raise WeightSyncError(f"the weight-update group is out of step ({self.broken}); "
                                  "close() and create a new one")
        if len(engines) != self.num_engines:
            raise ValueError(f"engines: the group was made for {self.num_engines} engine(s), "
                             f"got {len(engines)}")
        on_device = [(n, t.detach().to(self.device)) for n, t in named_tensors]
        if self.bucket_bytes is None:
            tensors = [(n, t.contiguous()) for n, t in on_device]
            self._wait(self._start(engines, tensors, [t for _, t in tensors], None, version,
                                   True))
            return sum(t.numel() * t.element_size() for _, t in tensors)
        groups = bucket_runs(on_device, self.bucket_bytes)
        packs = self.pack if self.pack is not None else self.device.type == "cuda"
        return self._pipeline(engines, groups, version,
                              self._packer(groups) if packs else _as_tensors)

    def _packer(self, groups: list[list[tuple[str, torch.Tensor]]]) -> Prepare:
        """What `_pipeline` sends for each group when packing: its bytes back to back in one
        of two reused send buffers (a bucket bigger than `bucket_bytes` as it is), a buffer
        refilled only once the broadcast that last read it has completed."""
        bucket_bytes = self.bucket_bytes
        assert bucket_bytes is not None
        slot_bytes = max((run_bytes(g) for g in groups
                          if own_bytes(g, bucket_bytes) is None), default=0)
        slot_user: dict[int, Call] = {}   # send slot -> the last call that broadcast from it
        num_packed = [0]

        def prepare(group: list[tuple[str, torch.Tensor]]
                    ) -> tuple[list[torch.Tensor], Optional[str], Callable[[Call], None]]:
            own = own_bytes(group, bucket_bytes)
            if own is not None:
                return [own], "flattened_bucket", lambda call: None
            slot = num_packed[0] % BucketBuffers.NUM_SLOTS
            user = slot_user.get(slot)
            if user is not None:   # its bytes must have left before we overwrite them
                _sent(user, self.timeout_s)
            send = pack_run(group, self.buffers.slot(slot, slot_bytes, self.device))
            num_packed[0] += 1
            return [send], "flattened_bucket", lambda call: slot_user.__setitem__(slot, call)

        return prepare

    def _pipeline(self, engines: Sequence[Any], groups: list[list[tuple[str, torch.Tensor]]],
                  version: str, prepare: Prepare) -> int:
        """One engine call per group, `MAX_IN_FLIGHT` outstanding (engines that take calls in
        the order sent receive group k+1 while they apply group k); `prepare(group)` gives the
        broadcasts of a call, its load_format and what to note once the call started."""
        moved = 0
        in_flight: list[Call] = []   # oldest first; at most `depth`
        depth = pipeline_depth(engines, MAX_IN_FLIGHT)
        try:
            for index, group in enumerate(groups):
                last = index == len(groups) - 1
                sends, load_format, started = prepare(group)
                if len(in_flight) >= depth:
                    self._wait(in_flight.pop(0))
                call = self._start(engines, group, sends, load_format,
                                   version if last else step_version(version, index), last)
                in_flight.append(call)
                started(call)
                moved += sum(t.numel() * t.element_size() for t in sends)
            while in_flight:
                self._wait(in_flight.pop(0))
        except BaseException:
            for call in in_flight:   # never leave a call (or a send buffer in use) behind
                if not call.settled:
                    try:
                        self._wait(call)
                    except BaseException:  # noqa: BLE001 - the first failure is the one raised
                        pass
            raise
        return moved

    def _start(self, engines: Sequence[Any], tensors: list[tuple[str, torch.Tensor]],
               sends: list[torch.Tensor], load_format: Optional[str], version: str,
               last: bool) -> Call:
        """Start one engine call per engine (in threads) announcing `tensors` (names, dtypes,
        shapes) and rank 0's broadcasts of `sends`: the tensors themselves, or their one
        bucket buffer."""
        names = [n for n, _ in tensors]
        dtypes = [dtype_to_str(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        calls = [start_call(e, "update_weights_from_distributed", names, dtypes, shapes,
                            group_name=self.group_name, load_format=load_format,
                            flush_cache=last, weight_version=version) for e in engines]
        assert self.group is not None
        return Call(calls, [self.group.broadcast(t) for t in sends])

    def _wait(self, call: Call) -> None:
        """Wait until every engine answered and every broadcast completed; an engine's failure
        is raised (and marks the group out of step if its broadcasts never drained)."""
        call.settled = True
        try:
            call_all(call.engine_calls, self.timeout_s)
        except BaseException as e:
            if not _all_done(call.works, DRAIN_WAIT_S):
                self.broken = f"a broadcast was not received: {e}"
            raise
        for w in call.works:
            w.wait()


@dataclass
class Call:
    """One engine call in flight: the engines' answers and rank 0's broadcast works."""

    engine_calls: list[Future[Any]]
    works: list[Any]
    settled: bool = False


MAX_IN_FLIGHT = 2
"""Bucket calls outstanding at once: the engine receives bucket k+1 while it applies bucket k
(it posts a call's receives as soon as the call arrives), and the trainer packs the next one
meanwhile."""

DRAIN_WAIT_S = 5.0
"""How long a refused update's broadcasts may take to finish: an engine that refuses after
receiving has drained them (rank 0's side completes a moment later); one that refused before
never will, and the group is out of step."""


Prepare = Callable[[list[tuple[str, torch.Tensor]]],
                   tuple[list[torch.Tensor], Optional[str], Callable[[Call], None]]]
"""What a bucketed push broadcasts for one group (`DistributedTransport._pipeline`)."""


def _as_tensors(group: list[tuple[str, torch.Tensor]]
                ) -> tuple[list[torch.Tensor], Optional[str], Callable[[Call], None]]:
    """An unpacked group: each tensor its own broadcast, straight from the trainer's memory
    (``load_format`` None, as an unbucketed push sends them)."""
    return [t for _, t in group], None, lambda call: None


def _sent(call: Call, timeout_s: float) -> None:
    """Wait until rank 0's broadcasts of `call` completed (its send buffer may be refilled);
    a failed broadcast is raised by that call's `_wait`."""
    _all_done(call.works, timeout_s)


def _all_done(works: list[Any], timeout_s: float) -> bool:
    for w in works:
        try:
            w.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            return False
    return True
