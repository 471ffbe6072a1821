"""A tensor-parallel rank other than 0: its model shard and KV pool, driven by rank 0.

    loop:  op from rank 0's pipe
             b"F"  forward: write the table rows, run the model (collectives with the others)
             b"C"  ControlOp -> the handler below -> Final back to rank 0; Verdict (inside
                   a disk or tensor update, through WorkerCommit; for a broadcast, here);
                   StopOp
           meanwhile: weight-update groups joining in the background, and broadcasts being
           received (checked once complete: Prepared; applied on rank 0's Verdict), report
           when done

The handlers do for this rank's shard what rank 0's RL control does for its own: read, map or
receive the update and load its slice (all or nothing across ranks: ``WorkerCommit``), release
and resume memory by tag, join and leave weight-update groups (rank ``rank_offset + tp_rank``,
as SGLang's engines join), report for ``check_integrity``. Requests, the radix tree and the
flags of an update (versions, flushes, aborts) are rank 0's alone.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.control.weight_checks import RankChecker, check_args
from rollout_engine.memory.memory_saver import TAGS, create_memory_saver
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.parallel.context import TPContext, replicated_checksum
from rollout_engine.protocol.messages import BusyError, WeightSlice
from rollout_engine.runtime import tp_wire as wire
from rollout_engine.runtime.tp_leader import AGREED
from rollout_engine.weights import refit
from rollout_engine.weights.disk_reader import PartialLoadError
from rollout_engine.weights.loader import load_weights, plan_targets, read_weight

__all__ = ["TPWorker", "WorkerCommit"]

logger = logging.getLogger(__name__)


class WorkerCommit:
    """``WeightCommit`` of a rank > 0: report the check to rank 0, wait for its verdict."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.call_id: Optional[int] = None   # the update being run
        self.agreed = False

    def agree(self, error: Optional[str]) -> None:
        if self.call_id is None or self.agreed:
            return   # the first load: nothing to agree with
        self.agreed = True
        self.conn.send(wire.Prepared(self.call_id, error))
        data = self.conn.recv_bytes()
        verdict = pickle.loads(data[1:]) if data[:1] == wire.OP else None
        if not isinstance(verdict, wire.Verdict) or verdict.call_id != self.call_id:
            raise RuntimeError(f"expected rank 0's verdict on call {self.call_id}, got "
                               f"{type(verdict).__name__}")
        if not verdict.ok:
            raise ValueError(verdict.message)


@dataclass
class _Receiving:
    """A broadcast update being received (``update_weights_from_distributed``)."""

    call_id: int
    receipt: refit.Receipt
    received: Optional[list[tuple[str, torch.Tensor]]] = None
    error: Optional[str] = None
    prepared: bool = False


class TPWorker:
    def __init__(self, config: EngineConfig, tp: TPContext, conn: Connection) -> None:
        self.config, self.tp, self.conn = config, tp, conn
        self.runner = ModelRunner(config, tp=tp)
        self.model = self.runner.model
        self.device = self.runner.device
        self.memory_saver = create_memory_saver(self.model, self.runner.kv_pool,
                                                config.enable_weights_cpu_backup, self.device,
                                                graphs=self.runner.graphs)
        self.groups = refit.WeightUpdateGroups(self.device, tp_rank=tp.rank)
        self.mapped: Optional[refit.MappedStorages] = None
        self.commit = WorkerCommit(conn)
        tp.commit = self.commit
        self.checker = RankChecker(tp.rank, tp.size)   # weights_checker's snapshots
        self.forward_passes = 0
        self.joining: list[tuple[int, str, Future]] = []   # (call id, group, rendezvous)
        self.receiving: list[_Receiving] = []

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.conn.send(wire.Ready(self.tp.rank, os.getpid(),
                                  self.runner.max_total_num_tokens))
        while True:
            if self.joining or self.receiving:
                self._joined()
                self._received()
                if not self.conn.poll(0.02):
                    continue
            data = self.conn.recv_bytes()
            tag = data[:1]
            if tag == wire.FORWARD:
                self._forward(data)
                continue
            op = pickle.loads(data[1:])
            if isinstance(op, wire.StopOp):
                return
            if isinstance(op, wire.Verdict):
                self._apply_broadcast(op)
                continue
            if not isinstance(op, wire.ControlOp):
                raise RuntimeError(f"unexpected {type(op).__name__} from rank 0")
            self._control(op)

    @torch.inference_mode()
    def _forward(self, data: bytes) -> None:
        fb = wire.decode_forward(data, self.device, self.runner.req_to_token.table)
        self.runner.forward(fb)
        self.forward_passes += 1

    def _control(self, op: wire.ControlOp) -> None:
        handler = getattr(self, f"rpc_{op.method}")
        # only a weight update waits for rank 0's verdict; any other call just answers
        self.commit.call_id = op.call_id if op.method in AGREED else None
        self.commit.agreed = False
        try:
            result = handler(op.call_id, **op.kwargs)
            final = None if result is _DEFERRED else wire.Final(op.call_id, True, result)
        except PartialLoadError as e:
            final = wire.Final(op.call_id, False, message=str(e), fatal=True)
        except Exception as e:  # noqa: BLE001 - answered to rank 0
            if not self.commit.agreed:   # failed before its check was reported
                try:
                    self.commit.agree(f"{type(e).__name__}: {e}")
                except ValueError:
                    pass   # rank 0's refusal, as expected
            status = 409 if isinstance(e, BusyError) else 400 if isinstance(
                e, (ValueError, TypeError)) else 504 if isinstance(e, TimeoutError) else 500
            final = wire.Final(op.call_id, False, message=f"{e}", status=status)
        finally:
            self.commit.call_id = None
        if final is not None:
            self.conn.send(final)

    def _joined(self) -> None:
        for entry in [j for j in self.joining if j[2].done()]:
            self.joining.remove(entry)
            call_id, group_name, future = entry
            try:
                self.groups.finish_init(group_name, future)
                final = wire.Final(call_id, True, {"group_name": group_name})
            except Exception as e:  # noqa: BLE001 - answered to rank 0
                final = wire.Final(call_id, False, message=str(e), status=504)
            self.conn.send(final)

    def _received(self) -> None:
        """Check each broadcast whose bytes all arrived and tell rank 0 (``Prepared``)."""
        for r in self.receiving:
            if r.prepared or not r.receipt.future.done():
                continue
            try:
                r.received = r.receipt.future.result()
                self._check_writable()
                plan_targets(self.model, [(n, tuple(t.shape), t.dtype) for n, t in r.received])
            except Exception as e:  # noqa: BLE001 - told to rank 0
                r.error = f"{type(e).__name__}: {e}"
            r.prepared = True
            self.conn.send(wire.Prepared(r.call_id, r.error))

    def _apply_broadcast(self, verdict: wire.Verdict) -> None:
        r = next((x for x in self.receiving if x.call_id == verdict.call_id), None)
        if r is None:
            raise RuntimeError(f"a verdict for call {verdict.call_id}, which is not a "
                               "broadcast being received here")
        self.receiving.remove(r)
        try:
            if not (verdict.ok and r.error is None and r.received is not None):
                final = wire.Final(r.call_id, False, status=400,
                                   message=r.error or verdict.message)
            else:
                try:   # checked and agreed already: WorkerCommit is not in a call here
                    report = load_weights(self.model, r.received)
                    final = wire.Final(r.call_id, True, {"num_tensors": report.num_tensors})
                except Exception as e:  # noqa: BLE001 - its shard may be half written
                    final = wire.Final(r.call_id, False, message=str(e), fatal=True)
        finally:
            self.groups.settle(r.receipt)
        self.conn.send(final)

    # -- weights (the same paths as rank 0's rl_control, on this rank's shard) ----------------
    def rpc_update_weights_from_disk(self, call_id: int, model_path: str,
                                     **flags: Any) -> dict[str, Any]:
        self._check_writable()
        report = refit.refit_from_disk(self.model, model_path)
        return {"num_tensors": report.num_tensors, "num_bytes": report.num_bytes}

    def rpc_update_weights_from_tensor(self, call_id: int, serialized_named_tensors: list[str],
                                       load_format: Optional[str] = None,
                                       **flags: Any) -> dict[str, Any]:
        """Rank 0's refit (``refit.refit_from_serialized``) on this rank's entry or slice."""
        self._check_writable()
        if self.mapped is None:
            self.mapped = refit.MappedStorages.for_model(self.model)
        report = refit.refit_from_serialized(self.model, serialized_named_tensors, load_format,
                                             self.mapped)
        return {"num_tensors": report.num_tensors, "num_bytes": report.num_bytes}

    def rpc_update_weights_from_distributed(self, call_id: int, names: list[str],
                                            dtypes: list[str], shapes: list[list[int]],
                                            group_name: str = "weight_update_group",
                                            load_format: Optional[str] = None,
                                            **flags: Any) -> object:
        """Posted, as on rank 0 (which keeps serving meanwhile): checked once received
        (``_received``), applied on rank 0's verdict (``_apply_broadcast``)."""
        groups = self.groups
        previous = groups.in_flight[-1] if groups.in_flight else None
        receipt = groups.post(list(names), list(dtypes), shapes, group_name, load_format,
                              after=previous)
        self.receiving.append(_Receiving(call_id, receipt))
        return _DEFERRED

    def _check_writable(self) -> None:
        if "weights" in self.memory_saver.released:
            raise BusyError("weights are released; resume_memory_occupation(['weights']) first")

    def rpc_init_weights_update_group(self, call_id: int, master_address: str,
                                      master_port: int, rank_offset: int, world_size: int,
                                      group_name: str = "weight_update_group",
                                      backend: str = "nccl") -> object:
        future = self.groups.start_init(master_address, master_port, rank_offset, world_size,
                                        group_name, backend,
                                        self.config.weight_update_group_timeout)
        self.joining.append((call_id, group_name, future))
        return _DEFERRED

    def rpc_destroy_weights_update_group(self, call_id: int,
                                         group_name: str = "weight_update_group") -> dict:
        self.groups.destroy(group_name)
        return {"group_name": group_name}

    def rpc_get_weights_by_name(self, call_id: int, name: str,
                                truncate_size: int = 100) -> WeightSlice:
        t = read_weight(self.model, name)
        part = (t[:truncate_size] if t.dim() else t).detach().float().contiguous().cpu()
        return WeightSlice(list(part.shape), part.numpy().tobytes())

    def rpc_weights_checker(self, call_id: int, action: str = "checksum",
                            allow_quant_error: bool = False, selector: str = "all",
                            skip_tensor_list: Optional[list[str]] = None) -> dict[str, Any]:
        """This rank's part of ``weights_checker`` (rank 0 checked the arguments and did its
        own): its slices snapshotted, reset, compared or hashed."""
        skip = check_args(action, selector, skip_tensor_list)
        models = [("target", self.model)] if selector in ("target", "all") else []
        return self.checker.run(action, models, skip)

    # -- memory and invariants -----------------------------------------------------------------
    def rpc_release_memory_occupation(self, call_id: int, tags: Optional[list[str]] = None,
                                      weights_backup: Optional[bool] = None) -> dict[str, Any]:
        tags = list(TAGS) if tags is None else tags   # rank 0 checked them
        freed = self.memory_saver.release(tags, weights_backup)
        if "weights" in tags:
            if self.mapped is not None:
                self.mapped.clear()
            self.groups.release_buffers()
        return {"bytes_freed": freed}

    def rpc_resume_memory_occupation(self, call_id: int,
                                     tags: Optional[list[str]] = None) -> dict[str, Any]:
        stale = self.memory_saver.resume(list(TAGS) if tags is None else tags)
        return {"stale": stale}

    def rpc_check_integrity(self, call_id: int) -> dict[str, Any]:
        weights = (None if "weights" in self.memory_saver.released
                   else replicated_checksum(self.model))
        return {"tp_rank": self.tp.rank, "pid": os.getpid(),
                "forward_passes": self.forward_passes,
                "released": sorted(self.memory_saver.released),
                "max_total_num_tokens": self.runner.max_total_num_tokens,
                "replicated_checksum": weights}


_DEFERRED = object()   # the handler answers later (a group being joined)


def crash_report(rank: int, error: BaseException) -> wire.Crashed:
    """``error`` as rank 0 passes it on to callers: its type and message (the traceback is
    this rank's log's, not theirs)."""
    return wire.Crashed(rank, "".join(traceback.format_exception_only(error)).strip())
