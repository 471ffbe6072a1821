"""vLLM's native weight transfer on the engine side (``protocol/vllm_wire.py`` is the wire).

    init      join the trainer's group as rank ``rank_offset`` (a rendezvous off the loop):
              on CUDA vLLM's own (its store keys, NCCL unique id and warm-up:
              ``protocol/vllm_nccl.py``), so vLLM's trainer can drive it; on CPU, with no
              NCCL, a gloo group joined as ``init_weights_update_group`` joins one; an
              ``init_info`` without rendezvous fields selects vLLM's ipc backend instead: no
              group, each update's tensors opened from the trainer's CUDA IPC handles and
              kept with the session (on CPU refused, once the update was checked)
    start     open a session
    update    post this call's receives (per tensor, or vLLM's packed chunks) and return to
              the loop; once every byte arrived the tensors are checked against the model and
              kept with the session. Nothing is written yet.
    finish    every tensor the session received is loaded in one step between batches (one
              new weight generation: KV computed on the old weights is never matched again),
              and the version label set

So the four phases are atomic: requests are served on the old weights until ``finish``, and a
refused ``update`` (a name the model lacks, a shape or dtype it cannot take) ends the session
with nothing written, as vLLM's worker ends its session on an error. Its broadcasts are still
drained first, so the trainer never hangs on a refusal.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from rollout_engine.control.dispatch import Deferred
from rollout_engine.control.rl_control import RLControl
from rollout_engine.protocol.messages import BusyError
from rollout_engine.protocol.sglang_payloads import refit_payload_cap
from rollout_engine.protocol.vllm_ipc import (
    IpcInit,
    is_ipc_init_info,
    parse_ipc_init_info,
    parse_ipc_update_info,
    rebuild,
)
from rollout_engine.protocol.vllm_nccl import join_vllm_nccl
from rollout_engine.protocol.vllm_wire import (
    TransferInit,
    TransferUpdate,
    packed_chunks,
    parse_init_info,
    parse_update_info,
)
from rollout_engine.protocol.weight_broadcast import unflatten
from rollout_engine.weights.loader import WeightLoadReport, load_weights, plan_targets
from rollout_engine.weights.update_groups import Receipt

__all__ = ["VLLM_GROUP", "VllmTransfer"]

VLLM_GROUP = "vllm_weight_transfer"
"""The weight-update group the native transfer joins (its store keys are prefixed with it)."""

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class TransferSession:
    """An open start .. finish: the tensors received so far, in arrival order."""

    received: NamedTensors = field(default_factory=list)
    num_updates: int = 0
    # the ipc backend's packed buffer, opened once for all of its chunks (vllm_ipc.rebuild)
    ipc_opened: dict[tuple, torch.Tensor] = field(default_factory=dict)


class VllmTransfer:
    """The native transfer's control calls over ``rl`` (its update groups, model and refit
    step). One group and one session at a time."""

    def __init__(self, rl: RLControl) -> None:
        self.rl = rl
        self.init: Optional[Union[TransferInit, IpcInit]] = None
        self.session: Optional[TransferSession] = None
        self.receiving = 0   # update calls whose broadcasts are still arriving

    # -- init / shutdown -----------------------------------------------------------------------
    def rpc_vllm_init_weight_transfer(self, init_info: dict[str, Any]
                                      ) -> Deferred | dict[str, Any]:
        """Join the trainer's group off the loop (requests keep being served); waits at most
        ``weight_update_group_timeout`` seconds for the trainer. A group joined before is left
        first (as vLLM replaces its communicator: a restarted trainer simply inits again),
        unless an update is open. An ``init_info`` without rendezvous fields selects the ipc
        backend (``protocol/vllm_ipc.py``): nothing to join."""
        if is_ipc_init_info(init_info):
            ipc = parse_ipc_init_info(init_info)
            if self.init is not None or VLLM_GROUP in self.rl.groups.groups:
                self.rpc_vllm_shutdown_weight_transfer()
            self.init = ipc
            return {"backend": "ipc", "packed": ipc.packed}
        info = parse_init_info(init_info)
        rl = self.rl
        if self.init is not None or VLLM_GROUP in rl.groups.groups:
            self.rpc_vllm_shutdown_weight_transfer()
        device = rl.runner.device
        if device.type == "cuda":   # vLLM's own rendezvous and NCCL communicator
            backend = "nccl"
            future = self._start_nccl_join(info, device)
        else:   # no NCCL: the same protocol over a gloo group
            backend = "gloo"
            future = rl.groups.start_init(info.master_address, info.master_port,
                                          info.rank_offset, info.world_size, VLLM_GROUP,
                                          backend, rl.group_timeout_s)

        def finish(done: Future) -> dict[str, Any]:
            rl.groups.finish_init(VLLM_GROUP, done)
            self.init = info
            return {"backend": backend, "rank": info.rank_offset, "packed": info.packed}

        return Deferred(future, finish)

    def _start_nccl_join(self, info: TransferInit, device: torch.device) -> Future:
        """vLLM's StatelessProcessGroup rendezvous and communicator (``protocol/vllm_nccl.py``)
        in a helper thread; the future yields the group ``finish_init`` registers."""
        groups = self.rl.groups
        if VLLM_GROUP in groups.pending:
            raise ValueError("init_weight_transfer_engine: a rendezvous is already running")
        if not info.rank_offset < info.world_size:
            raise ValueError(f"init_info.rank_offset: engine rank {info.rank_offset} must be "
                             f"in [1, {info.world_size}) (rank 0 is the trainer)")
        future: Future = Future()
        groups.pending[VLLM_GROUP] = future
        timeout_s = self.rl.group_timeout_s

        def join() -> None:
            try:
                future.set_result(join_vllm_nccl(info.master_address, info.master_port,
                                                 info.rank_offset, info.world_size, device,
                                                 timeout_s))
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                future.set_exception(e)

        threading.Thread(target=join, daemon=True, name="vllm-weight-transfer-join").start()
        return future

    def rpc_vllm_shutdown_weight_transfer(self) -> dict[str, Any]:
        """Leave the group (vLLM refuses this during an update, and so do we)."""
        if self.session is not None or self.receiving:
            raise BusyError("shutdown_weight_transfer_engine: a weight update is open; call "
                            "finish_weight_update first")
        if self.init is not None:
            if not isinstance(self.init, IpcInit):
                self.rl.groups.destroy(VLLM_GROUP)
            self.init = None
        return {"initialized": False}

    # -- one update ----------------------------------------------------------------------------
    def rpc_vllm_start_weight_update(self) -> dict[str, Any]:
        self._require_init("start_weight_update")
        if self.session is not None:
            raise ValueError("start_weight_update: a weight update is already open; call "
                             "finish_weight_update first")
        self.session = TransferSession()
        return {"started": True}

    def rpc_vllm_update_weights(self, update_info: Any) -> Deferred | dict[str, Any]:
        """Post the receives of one ``update_info`` and return to the loop; its answer comes
        once every byte arrived and the tensors were checked (nothing is written yet)."""
        init = self._require_init("update_weights")
        session = self.session
        if session is None:
            raise ValueError("update_weights: call start_weight_update first")
        if isinstance(init, IpcInit):
            return self._update_ipc(update_info, init, session)
        try:
            update = parse_update_info(update_info)
            receipt = self._post(update, init)
        except BaseException:
            self.session = None   # as vLLM's worker: an error ends the session
            raise
        self.receiving += 1

        def finish(done: Future) -> dict[str, Any]:
            self.receiving -= 1
            try:
                received = done.result()
                if self.session is not session:
                    raise ValueError("update_weights: the weight update was ended while this "
                                     "call was being received")
                # every check load_weights makes, before anything is kept
                plan_targets(self.rl.runner.model,
                             [(n, tuple(t.shape), t.dtype) for n, t in received])
                session.received.extend(received)
                session.num_updates += 1
                return {"num_tensors": len(received)}
            except BaseException:
                if self.session is session:
                    self.session = None
                raise
            finally:
                self.rl.groups.settle(receipt)

        return Deferred(receipt.future, finish)

    def rpc_vllm_finish_weight_update(self, weight_version: Optional[str] = None
                                      ) -> dict[str, Any]:
        """Load everything the session received (one refit), then label it ``weight_version``."""
        self._require_init("finish_weight_update")
        session = self.session
        if session is None:
            raise ValueError("finish_weight_update: no weight update is open; call "
                             "start_weight_update first")
        if self.receiving:
            raise BusyError("finish_weight_update: an update_weights call is still being "
                            "received; wait for its answer")
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"weight_version: must be a string or null, got {weight_version!r}")
        self.session = None
        rl = self.rl
        if not session.received:
            if weight_version is not None:
                rl.weights.version = weight_version
            return {"weight_version": rl.weights.version, "num_tensors": 0}
        rl._before_update(False, weight_version=weight_version)
        model = rl.runner.model
        pairs = session.received

        def load() -> WeightLoadReport:
            return load_weights(model, pairs)

        result = rl._apply(load, weight_version, flush_cache=True)
        return {**result, "num_updates": session.num_updates}

    def _update_ipc(self, update_info: Any, init: IpcInit,
                    session: TransferSession) -> dict[str, Any]:
        """The ipc backend's update: every check (the handles, then the names, shapes and
        dtypes against the model) before the trainer's tensors are opened on this GPU and
        kept with the session; on CPU refused once the update was found well formed."""
        model = self.rl.runner.model
        device = self.rl.runner.device
        try:
            update = parse_ipc_update_info(update_info, init, refit_payload_cap(model))
            plan_targets(model, list(zip(update.names, update.shapes, update.dtypes)))
            if device.type != "cuda":
                raise ValueError(
                    "update_weights: the ipc weight-transfer backend needs CUDA (the trainer's "
                    f"tensors arrive as CUDA IPC handles) and this engine runs on {device}; "
                    "init the nccl backend instead (init_info with master_address, "
                    "master_port, rank_offset and world_size), which runs over gloo here")
            received = rebuild(update, device, session.ipc_opened)
        except BaseException:
            self.session = None   # as vLLM's worker: an error ends the session
            raise
        session.received.extend(received)
        session.num_updates += 1
        return {"num_tensors": len(received)}

    # -- receiving -----------------------------------------------------------------------------
    def _require_init(self, what: str) -> Union[TransferInit, IpcInit]:
        if self.init is None:
            raise ValueError(f"{what}: the weight transfer is not initialized; call "
                             "init_weight_transfer_engine first")
        return self.init

    def _post(self, update: TransferUpdate, init: TransferInit) -> Receipt:
        """Post every broadcast of ``update`` on the group, in wire order, each into a fresh
        tensor the session keeps (no staging slot: the data lives until ``finish``)."""
        groups = self.rl.groups
        group = groups.groups[VLLM_GROUP]
        device = self.rl.runner.device
        packed = init.packed if update.packed is None else update.packed
        works: list[Any] = []
        if packed:
            limit = update.packed_buffer_size_bytes or init.packed_buffer_size_bytes
            sizes = update.num_bytes()
            pieces: list[tuple[range, torch.Tensor]] = []
            for chunk in packed_chunks(sizes, limit):
                buf = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8,
                                  device=device)
                works.append(group.broadcast(buf))
                pieces.append((chunk, buf))

            def unpack() -> NamedTensors:
                out: NamedTensors = []
                for chunk, buf in pieces:
                    tensors = unflatten(buf, [update.dtypes[i] for i in chunk],
                                        [update.shapes[i] for i in chunk])
                    out.extend(zip((update.names[i] for i in chunk), tensors))
                return out
        else:
            named = [(n, torch.empty(s, dtype=d, device=device))
                     for n, d, s in zip(update.names, update.dtypes, update.shapes)]
            works = [group.broadcast(t) for _, t in named]
            unpack = named.copy
        after = groups.in_flight[-1] if groups.in_flight else None
        receipt = Receipt(unpack, works, None, device, after)
        groups.in_flight.append(receipt)
        return receipt
