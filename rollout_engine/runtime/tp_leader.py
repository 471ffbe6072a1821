"""Rank 0's side of tensor parallelism: the other ranks' pipes, their control calls, liveness.

Rank 0 runs the whole scheduler (requests, radix tree, KV allocation, sampling); the other
ranks hold a shard of the model and of the KV pool and do what rank 0 tells them:

    every forward      ``send_forward`` (the ModelRunner, before its own part)
    weight updates     mirrored as they arrive (``begin_call``: the ranks read, receive or map
                       their part while rank 0 does), then agreed (``LeaderCommit``: every rank
                       checked its part, or none writes), then answered (``finish_call``)
    sleep, wake, ...   mirrored once rank 0 has done them (``finish_call``), the weight
                       checker too (each rank checks its own slices; checksums appended)

``TPLeaderChannel`` is rank 0's channel to the frontend with these hooks on it, so the
scheduler and its loop stay as they are. A rank that exits, crashes or stops answering raises
``TPRankDied`` (the loop reports it to the frontend as the scheduler's death): never a hang.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.parallel.context import Shard, replicated_checksum
from rollout_engine.protocol.messages import (
    ControlReq,
    ControlResult,
    SchedulerDied,
    SchedulerReady,
    WeightSlice,
)
from rollout_engine.runtime import tp_wire as wire
from rollout_engine.runtime.channels import Channel

__all__ = ["Leader", "LeaderCommit", "TPLeaderChannel", "TPRankDied"]

AGREED = ("update_weights_from_disk", "update_weights_from_tensor",
          "update_weights_from_distributed")
AT_ARRIVAL = (*AGREED, "init_weights_update_group")   # the ranks must run these with rank 0
AFTER_SUCCESS = ("release_memory_occupation", "resume_memory_occupation",
                 "destroy_weights_update_group", "check_integrity", "get_weights_by_name",
                 "weights_checker")


class TPRankDied(RuntimeError):
    """A tensor-parallel rank exited, crashed or stopped answering: the engine cannot go on."""


@dataclasses.dataclass
class _Call:
    call_id: int
    method: str
    kwargs: dict[str, Any]
    agreed: bool = False


class Leader:
    """The other ranks (``workers[i]`` is rank ``i + 1``), seen from rank 0."""

    def __init__(self, workers: Sequence[Any], timeout_s: float, op_timeout_s: float) -> None:
        """``workers``: ``launch.RankProcess`` of ranks 1.. (``proc``, ``conn``, ``pid``);
        ``timeout_s``: the longest a rank may take to answer; ``op_timeout_s``: a forward's
        collective (``dist_timeout``)."""
        self.workers = list(workers)
        self.timeout_s = timeout_s
        self.op_timeout_s = op_timeout_s
        self.updates: list[_Call] = []           # weight updates not agreed yet, in call order
        self.methods: dict[int, _Call] = {}      # mirrored calls not answered yet
        self.stash: list[tuple[int, Any]] = []   # messages read while waiting for another
        self.forwards_sent = 0
        self.extended: set[int] = set()          # pool rows extended, not decoded since
        self.model: Any = None                   # rank 0's model (weight reads)

    # -- pipes ---------------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        for rank, w in enumerate(self.workers, start=1):
            try:
                w.conn.send_bytes(data)
            except OSError:
                self._died(rank, "its pipe to rank 0 is closed")

    def _died(self, rank: int, why: str) -> None:
        w = self.workers[rank - 1]
        try:   # its last words (a Crashed report) may still be in the pipe
            while w.conn.poll(0):
                self.stash.append((rank, w.conn.recv()))
        except (EOFError, OSError):
            pass
        try:
            code = w.proc.wait(timeout=2)
        except Exception:  # noqa: BLE001 - still running (hung) or already reaped
            code = w.proc.poll()
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"code {code}"
            why = f"it exited ({how})"
        crashed = next((m.message for r, m in self.stash
                        if r == rank and isinstance(m, wire.Crashed)), "")
        raise TPRankDied(f"tensor-parallel rank {rank} (pid {w.pid}) is gone: {why}"
                         + (f"; its error: {crashed}" if crashed else "")
                         + "; the engine cannot continue: restart it")

    def _read(self, rank: int, timeout: float) -> Optional[Any]:
        conn = self.workers[rank - 1].conn
        try:
            if not conn.poll(timeout):
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            self._died(rank, "its pipe to rank 0 closed")
        if isinstance(msg, wire.Crashed):
            self.stash.append((rank, msg))
            self._died(rank, "it crashed")
        return msg

    def _expect(self, rank: int, kind: type[Any], call_id: int) -> Any:
        """The next ``kind`` message of ``call_id`` from ``rank`` (others are kept)."""
        for i, (r, m) in enumerate(self.stash):
            if r == rank and isinstance(m, kind) and m.call_id == call_id:
                return self.stash.pop(i)[1]
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            msg = self._read(rank, timeout=0.5)
            if msg is None:
                if self.workers[rank - 1].proc.poll() is not None:
                    self._died(rank, "it exited")
                continue
            if isinstance(msg, kind) and msg.call_id == call_id:
                return msg
            self.stash.append((rank, msg))
        self._died(rank, f"it did not answer within {self.timeout_s:g} s")

    def check_alive(self) -> None:
        """Raise TPRankDied if a rank has exited or reported a crash (cheap: one poll each)."""
        for rank, w in enumerate(self.workers, start=1):
            if w.proc.poll() is not None:
                self._died(rank, "it exited")
            msg = self._read(rank, timeout=0)
            if msg is not None:
                self.stash.append((rank, msg))

    def raise_if_rank_died(self, error: BaseException) -> None:
        """After a failed collective: TPRankDied naming the rank if one is gone, else saying
        that one stopped answering (every rank still runs: stuck, or slower than the
        timeout)."""
        deadline = time.monotonic() + 2.0   # its exit may lag the closed connection a little
        while time.monotonic() < deadline:
            self.check_alive()
            time.sleep(0.05)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TPRankDied(f"a tensor-parallel collective failed ({first}) while every rank "
                         f"still runs: one is stuck or took longer than {self.op_timeout_s:g} s "
                         "(dist_timeout); the engine cannot continue: restart it") from error

    # -- startup and shutdown ------------------------------------------------------------------
    def wait_ready(self, ready: SchedulerReady) -> SchedulerReady:
        pids = [ready.info.get("pid")]
        for rank in range(1, len(self.workers) + 1):
            msg = self._expect(rank, wire.Ready, -1)
            if msg.max_total_num_tokens != ready.info["max_total_num_tokens"]:
                raise TPRankDied(f"tensor-parallel rank {rank} sized its KV pool to "
                                 f"{msg.max_total_num_tokens} tokens, rank 0 to "
                                 f"{ready.info['max_total_num_tokens']}")
            pids.append(msg.pid)
        return SchedulerReady({**ready.info, "tp_size": len(pids), "tp_pids": pids})

    def stop(self, timeout: float) -> None:
        """Ask the ranks to stop; one still running after ``timeout`` is killed (nothing of
        it outlives the engine: it holds no state of its own)."""
        try:
            self._send(wire.encode_op(wire.StopOp()))
        except TPRankDied:
            pass
        for w in self.workers:
            try:
                w.proc.wait(timeout)
            except Exception:  # noqa: BLE001 - it did not stop: end it
                w.proc.kill()
                w.proc.wait()

    # -- every step ----------------------------------------------------------------------------
    def send_forward(self, fb: ForwardBatch, table: torch.Tensor) -> None:
        """Send a forward's inputs; whole table rows for the requests extended now or since
        their last decode (``wire``: the radix tree may have swapped their slots since)."""
        rows = fb.req_pool_indices.tolist()
        extend = fb.mode != ForwardMode.DECODE
        full = [b for b, r in enumerate(rows) if extend or r in self.extended]
        self._send(wire.encode_forward(fb, table, full))
        if extend:   # sent whole now, but the tree may swap their slots after this forward
            self.extended.update(rows)
        else:
            self.extended.difference_update(rows)
        self.forwards_sent += 1

    # -- control calls -------------------------------------------------------------------------
    def begin_call(self, msg: ControlReq) -> None:
        """A control call reached rank 0; the ranks start the ones they must run alongside."""
        if msg.method not in AT_ARRIVAL + AFTER_SUCCESS:
            return
        if msg.deadline is not None and time.time() > msg.deadline:
            return   # the scheduler cancels it without running it
        call = _Call(msg.call_id, msg.method, msg.kwargs)
        self.methods[msg.call_id] = call
        if msg.method in AT_ARRIVAL:
            self._send(wire.encode_op(wire.ControlOp(msg.call_id, msg.method, msg.kwargs)))
            if msg.method in AGREED:
                self.updates.append(call)

    def agree(self, error: Optional[str]) -> None:
        """Rank 0 checked its part of the update it applies now (``error``: why it refuses):
        the oldest not agreed yet, as rank 0 applies updates in the order they came (a disk
        or tensor update is refused while broadcasts are still being received)."""
        if not self.updates:
            return   # not a mirrored update (the first load): nothing to agree with
        call = self.updates.pop(0)
        call.agreed = True
        refusals = []
        for rank in range(1, len(self.workers) + 1):
            prepared = self._expect(rank, wire.Prepared, call.call_id)
            if prepared.error is not None:
                refusals.append(f"tensor-parallel rank {rank}: {prepared.error}")
        ok = error is None and not refusals
        why = "; ".join(refusals) if refusals else f"rank 0 refused it: {error}"
        self._send(wire.encode_op(wire.Verdict(call.call_id, ok, "" if ok else why)))
        if error is None and refusals:
            raise ValueError(f"{why}; no rank changed its weights")

    def finish_call(self, result: ControlResult) -> ControlResult:
        """Rank 0's answer to a call, combined with the other ranks' (same shape)."""
        call = self.methods.pop(result.call_id, None)
        if call is None:
            return result
        if call in self.updates:
            self.updates.remove(call)
        if call.method in AT_ARRIVAL:
            if call.method in AGREED and not call.agreed:   # rank 0 stopped before checking
                for rank in range(1, len(self.workers) + 1):
                    self._expect(rank, wire.Prepared, call.call_id)
                self._send(wire.encode_op(wire.Verdict(
                    call.call_id, False, f"rank 0 did not apply it: {result.message}")))
        elif result.success:
            self._send(wire.encode_op(wire.ControlOp(call.call_id, call.method, call.kwargs)))
        else:
            return result
        finals = [self._expect(rank, wire.Final, call.call_id)
                  for rank in range(1, len(self.workers) + 1)]
        return merge(call, result, finals, self)


class LeaderCommit:
    """``WeightCommit`` of rank 0 (``parallel.context``)."""

    def __init__(self, leader: Leader) -> None:
        self.leader = leader

    def agree(self, error: Optional[str]) -> None:
        self.leader.agree(error)


def merge(call: _Call, result: ControlResult, finals: list[wire.Final],
          leader: Leader) -> ControlResult:
    """One answer for the engine: rank 0's, unless another rank failed; per-rank details under
    ``tp_ranks`` where they say something."""
    for rank, f in enumerate(finals, start=1):
        if f.fatal:
            raise TPRankDied(f"tensor-parallel rank {rank} failed while writing its weights "
                             f"({f.message}); the ranks may now hold different weights")
        if not f.ok and result.success:
            return ControlResult(result.call_id, False, message=(
                f"tensor-parallel rank {rank}: {f.message}"), status=f.status)
    if not result.success:
        return result
    out, method = result.result, call.method
    if method == "release_memory_occupation":
        out = {**out, "bytes_freed": out["bytes_freed"] + sum(f.result["bytes_freed"]
                                                              for f in finals),
               "tp_bytes_freed": [out["bytes_freed"], *(f.result["bytes_freed"] for f in finals)]}
    elif method == "check_integrity":
        mine = None if leader.model is None else _checksum_or_none(leader.model)
        for rank, f in enumerate(finals, start=1):
            theirs = f.result["replicated_checksum"]
            why = None
            if f.result["forward_passes"] != leader.forwards_sent:
                why = (f"ran {f.result['forward_passes']} forward passes, rank 0 sent "
                       f"{leader.forwards_sent}")
            elif None not in (mine, theirs) and theirs != mine:
                why = ("holds other values than rank 0 in the weights every rank keeps whole "
                       "(norms, biases): the ranks serve mixed weights; refit them all")
            if why is not None:
                return ControlResult(result.call_id, False, status=500,
                                     message=f"tensor-parallel rank {rank} {why}")
        out = {**out, "tp_ranks": [f.result for f in finals]}
    elif method == "weights_checker" and "ranks" in out:   # every rank's checksums
        out = {**out, "ranks": [*out["ranks"], *(r for f in finals for r in f.result["ranks"])]}
    elif method == "get_weights_by_name":
        shards = leader.model.tp_shards() if leader.model is not None else {}
        out = _joined_slice(out, [f.result for f in finals], shards.get(call.kwargs["name"]),
                            call.kwargs.get("truncate_size", 100))
    return dataclasses.replace(result, result=out)


def _checksum_or_none(model: Any) -> Optional[int]:
    """Rank 0's ``replicated_checksum``, or None while its weights are released."""
    if any(p.numel() == 0 for p in model.parameters()):
        return None
    return replicated_checksum(model)


def _joined_slice(mine: WeightSlice, others: list[Any], shard: Optional[Shard],
                  rows: int) -> WeightSlice:
    """The full weight's rows from every rank's slice: columns side by side for a
    row-parallel weight, rows one after another (then cut) for a column-parallel one."""
    if shard is None or shard.length == shard.full_shape[shard.dim]:   # whole (replicated)
        return mine
    parts = [torch.frombuffer(bytearray(s.data), dtype=torch.float32).view(s.shape)
             for s in [mine, *others]]
    joined = torch.cat(parts, dim=shard.dim)
    if shard.dim == 0:
        joined = joined[:rows]
    return WeightSlice(list(joined.shape), joined.contiguous().numpy().tobytes())


class TPLeaderChannel(Channel):
    """Rank 0's channel to the frontend, with the tensor-parallel hooks on it."""

    def __init__(self, inner: Channel, leader: Leader) -> None:
        self.inner = inner
        self.leader = leader

    def send(self, msg: Any) -> None:
        if isinstance(msg, SchedulerReady):
            try:
                msg = self.leader.wait_ready(msg)
            except Exception as e:
                self.inner.send(SchedulerDied(f"scheduler failed to start: {e}"))
                raise
        elif isinstance(msg, ControlResult):
            msg = self.leader.finish_call(msg)
        self.inner.send(msg)

    def wake(self) -> None:
        wake = getattr(self.inner, "wake", None)
        if wake is not None:
            wake()

    def recv(self, timeout: Optional[float]) -> Any:
        msg = self.inner.recv(timeout)
        if isinstance(msg, ControlReq):
            self.leader.begin_call(msg)
        elif msg is None:
            self.leader.check_alive()
        return msg
