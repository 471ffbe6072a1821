"""Data parallelism in one server (``--dp-size N``): N scheduler replicas behind one frontend.

    TokenizerManager --chan--> DataParallelChannel --> replica 0 (thread or child process)
                                 dispatcher          --> replica 1
                                 fan-out / merge     --> ...
              <-- one inbox <-- a reader thread per replica

The frontend keeps talking to one channel, as with one scheduler. Generation requests go to
one replica each, chosen by the dispatcher (``dispatch.py``); the ``n`` samples of one prompt
(a GRPO group) and equal prompts of one call go to the same replica, so they share its
radix-cached prefix. Aborts and shutdown go to every replica; control calls are fanned out
(``init_weights_update_group`` with ``rank_offset + i * tp_size`` for replica i, as SGLang
assigns DP ranks: the trainer's group has ``1 + dp_size * tp_size`` ranks for such an engine;
each replica's TP ranks add their own ``tp_rank``) and their answers
merged into one (``merge.py``). The frontend is told it is ready once every replica is; a
replica that dies takes the engine down (its SchedulerDied reaches the frontend).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Sequence
from typing import Any, Optional

from rollout_engine.config import EngineConfig
from rollout_engine.dp.dispatch import Load, create_dispatcher
from rollout_engine.dp.merge import merge_results
from rollout_engine.protocol.messages import (
    BatchOutput,
    ControlReq,
    ControlResult,
    GenerateReq,
    SchedulerDied,
    SchedulerReady,
)
from rollout_engine.runtime.channels import Channel
from rollout_engine.runtime.hosts import SchedulerHost, start_host
from rollout_engine.runtime.loop import Shutdown

__all__ = ["DataParallelChannel", "DataParallelHost"]


class DataParallelChannel(Channel):
    """The frontend's channel to N replicas (thread-safe: sends come from callers' threads,
    receives from the frontend's receiver thread)."""

    def __init__(self, replicas: Sequence[SchedulerHost], method: str,
                 ranks_per_replica: int = 1) -> None:
        self.replicas = list(replicas)
        self.ranks_per_replica = ranks_per_replica   # tp_size: each rank joins weight groups
        self.dispatcher = create_dispatcher(method, len(self.replicas))
        self.loads = [Load() for _ in self.replicas]
        self.placed: dict[str, tuple[int, int]] = {}   # rid -> (replica, tokens counted)
        self.calls: dict[int, tuple[str, list[Optional[ControlResult]]]] = {}
        self.ready: list[Optional[SchedulerReady]] = [None] * len(self.replicas)
        self.lock = threading.Lock()
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.closing = threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True,
                                         name=f"rollout-dp-reader-{i}")
                        for i in range(len(self.replicas))]
        for t in self.readers:
            t.start()

    # -- frontend -> replicas ----------------------------------------------------------------
    def send(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            self.send_many([msg])
        elif isinstance(msg, ControlReq):
            self._fan_out(msg)
        elif isinstance(msg, Shutdown):
            self.closing.set()
            self._to_all(msg)
        else:   # AbortReq: its rid or group may live on any replicas; elsewhere a no-op
            self._to_all(msg)

    def send_many(self, msgs: Sequence[Any]) -> None:
        """Send one call's requests: equal prompts (the n samples of a GRPO group) go to the
        replica the first of them was given."""
        chosen: dict[tuple[int, ...], int] = {}
        for msg in msgs:
            if not isinstance(msg, GenerateReq):
                self.send(msg)
                continue
            key = tuple(msg.input_ids)
            with self.lock:
                replica = chosen.get(key)
                if replica is None:
                    replica = self.dispatcher.pick(msg.input_ids, self.loads)
                    self.dispatcher.record(msg.input_ids, replica)
                    chosen[key] = replica
                tokens = len(msg.input_ids) + (msg.sampling_params.max_new_tokens or 0)
                self.placed[msg.rid] = (replica, tokens)
                self.loads[replica].requests += 1
                self.loads[replica].tokens += tokens
            self.replicas[replica].chan.send(msg)

    def _to_all(self, msg: Any) -> None:
        for r in self.replicas:
            try:
                r.chan.send(msg)
            except OSError:
                pass   # a dead replica: its reader reports it

    def _fan_out(self, msg: ControlReq) -> None:
        with self.lock:
            self.calls[msg.call_id] = (msg.method, [None] * len(self.replicas))
        for i, r in enumerate(self.replicas):
            kwargs = msg.kwargs
            if msg.method == "init_weights_update_group":
                kwargs = {**kwargs,
                          "rank_offset": kwargs["rank_offset"] + i * self.ranks_per_replica}
            elif msg.method == "update_weights_from_tensor" and i:
                # every replica reads the same payload; the sender took one shm reference per
                # storage, for one reader: the others keep it (two drops for one reference
                # unlink the trainer's files once the replicas unmap them, at the next sleep)
                kwargs = {**kwargs, "read_by_others": True}
            r.chan.send(dataclasses.replace(msg, kwargs=kwargs))

    # -- replicas -> frontend ----------------------------------------------------------------
    def _read(self, index: int) -> None:
        """Move replica `index`'s messages into the inbox; report its death once."""
        host = self.replicas[index]
        while not self.closing.is_set():
            try:
                msg = host.chan.recv(timeout=0.5)
            except (EOFError, OSError):
                msg = None if self.closing.is_set() else SchedulerDied(
                    f"dp rank {index}: the scheduler process closed its pipe (it died)")
                if msg is not None:
                    self.inbox.put((index, msg))
                return
            if msg is None:
                if not host.is_alive() and not self.closing.is_set():
                    self.inbox.put((index, SchedulerDied(
                        f"dp rank {index}: the scheduler exited unexpectedly")))
                    return
                continue
            self.inbox.put((index, msg))

    def recv(self, timeout: Optional[float]) -> Any:
        """The next message for the frontend: outputs as they come, a control call's merged
        answer once every replica answered, SchedulerReady once every replica is ready."""
        try:
            index, msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        while True:
            out = self._route(index, msg)
            if out is not None:
                return out
            try:   # absorbed (one part of a merge): take the next one without blocking long
                index, msg = self.inbox.get(timeout=timeout)
            except queue.Empty:
                return None

    def _route(self, index: int, msg: Any) -> Any:
        if isinstance(msg, BatchOutput):
            self._finished(msg)
            return msg
        if isinstance(msg, ControlResult):
            return self._part(index, msg)
        if isinstance(msg, SchedulerReady):
            self.ready[index] = msg
            return _merged_ready(self.ready) if all(self.ready) else None
        if isinstance(msg, SchedulerDied):
            return SchedulerDied(msg.message if msg.message.startswith("dp rank")
                                 else f"dp rank {index}: {msg.message}")
        return msg

    def _finished(self, batch: BatchOutput) -> None:
        with self.lock:
            for out in batch.outputs:
                if out.finished_reason is None:
                    continue
                placed = self.placed.pop(out.rid, None)
                if placed is not None:
                    replica, tokens = placed
                    self.loads[replica].requests -= 1
                    self.loads[replica].tokens -= tokens

    def _part(self, index: int, msg: ControlResult) -> Optional[ControlResult]:
        with self.lock:
            entry = self.calls.get(msg.call_id)
            if entry is None:
                return msg
            method, parts = entry
            parts[index] = msg
            if any(p is None for p in parts):
                return None
            del self.calls[msg.call_id]
        return merge_results(msg.call_id, method, parts)  # type: ignore[arg-type]

    def load_snapshot(self) -> list[Load]:
        """Requests and tokens in flight per replica, as the dispatcher sees them."""
        with self.lock:
            return [dataclasses.replace(x) for x in self.loads]


def _merged_ready(ready: Sequence[Optional[SchedulerReady]]) -> SchedulerReady:
    """Replica 0's announcement; the KV pool the frontend sizes requests by is the smallest."""
    infos = [r.info for r in ready if r is not None]
    info = dict(infos[0])
    info["max_total_num_tokens"] = min(i["max_total_num_tokens"] for i in infos)
    info["dp_pids"] = [i.get("pid") for i in infos]
    return SchedulerReady(info)


class DataParallelHost(SchedulerHost):
    """`config.dp_size` replicas (each as `config.scheduler_mode` says), one channel."""

    def __init__(self, config: EngineConfig) -> None:
        replica = dataclasses.replace(config, dp_size=1)
        self.replicas: list[SchedulerHost] = []
        try:
            for _ in range(config.dp_size):
                self.replicas.append(start_host(replica))
        except BaseException:
            self._stop_all(timeout=5)
            raise
        self.dp_chan = DataParallelChannel(self.replicas, config.load_balance_method,
                                           config.tp_size)
        self.chan = self.dp_chan
        self.pid = self.replicas[0].pid

    def is_alive(self) -> bool:
        return all(r.is_alive() for r in self.replicas)

    def stop(self, timeout: float) -> None:
        self.dp_chan.closing.set()
        self._stop_all(timeout)

    def _stop_all(self, timeout: float) -> None:
        """Every replica is asked to stop first, then each is waited for (they stop
        concurrently)."""
        for r in self.replicas:
            try:
                r.chan.send(Shutdown())
            except OSError:
                pass
        for r in self.replicas:
            r.stop(timeout)

