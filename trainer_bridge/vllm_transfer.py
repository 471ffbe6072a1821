"""The trainer side of vLLM's native weight transfer (``rollout_engine/protocol/vllm_wire.py``):
a server's ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update`` over HTTP, the weights broadcast from rank 0 of the group, per tensor
or in vLLM's packed chunks: on CUDA through vLLM's own NCCL rendezvous
(``rollout_engine/protocol/vllm_nccl.py``: a vLLM server can be the other side), on CPU a gloo
group.

    sender = VllmWeightSender("http://host:port", master_port=free_port())
    sender.init()                               # the server joins as rank 1
    sender.send(model.named_parameters(), weight_version="step-3")
    sender.shutdown()

``update_weights`` is answered only once its broadcasts have arrived, so it is posted from a
helper thread while this one broadcasts (as vLLM's own trainer does).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

import httpx
import torch

from rollout_engine.protocol.vllm_nccl import VllmNcclGroup, join_vllm_nccl
from rollout_engine.protocol.vllm_wire import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    dtype_name,
    packed_chunks,
)
from rollout_engine.protocol.weight_broadcast import UpdateGroup, flatten, join_update_group

__all__ = ["VllmTransferError", "VllmWeightSender", "broadcast_weights", "update_info"]

VLLM_GROUP = "vllm_weight_transfer"   # the engine's group name (control/vllm_transfer.py)


class VllmTransferError(RuntimeError):
    """A server answered a transfer call with an error (``status`` and its message)."""

    def __init__(self, path: str, status: int, message: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.path, self.status = path, status


def update_info(named: Sequence[tuple[str, torch.Tensor]],
                packed: Optional[bool] = None) -> dict[str, Any]:
    """The ``update_info`` of ``named`` (``packed`` None: the init's setting)."""
    info: dict[str, Any] = {"names": [n for n, _ in named],
                            "dtype_names": [dtype_name(t.dtype) for _, t in named],
                            "shapes": [list(t.shape) for _, t in named]}
    if packed is not None:
        info["packed"] = packed
    return info


def broadcast_weights(group: Union[UpdateGroup, VllmNcclGroup], named: Sequence[tuple[str, torch.Tensor]],
                      packed: bool, buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
                      ) -> None:
    """Rank 0's broadcasts of one update, in wire order: one per tensor, or one per packed
    chunk (tensors' bytes back to back, cut as vLLM cuts them). Returns once all are sent."""
    tensors = [t.detach().contiguous() for _, t in named]
    if packed:
        sizes = [t.numel() * t.element_size() for t in tensors]
        sends = [flatten([tensors[i] for i in chunk])
                 for chunk in packed_chunks(sizes, buffer_size_bytes)]
    else:
        sends = tensors
    for work in [group.broadcast(t) for t in sends]:
        work.wait()


class VllmWeightSender:
    """Rank 0 of a vLLM weight-transfer group with one server (rank 1; ``world_size`` > 2 when
    other servers join at the offsets they are given)."""

    def __init__(self, base_url: str, *, master_port: int, master_address: str = "127.0.0.1",
                 world_size: int = 2, rank_offset: int = 1, packed: bool = False,
                 packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                 backend: Optional[str] = None, timeout_s: float = 120.0,
                 api_key: Optional[str] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.master_address, self.master_port = master_address, master_port
        self.world_size, self.rank_offset = world_size, rank_offset
        self.packed, self.buffer_size = packed, packed_buffer_size_bytes
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        self.group: Optional[Union[UpdateGroup, VllmNcclGroup]] = None
        self._lock = threading.Lock()

    def post(self, path: str, body: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise VllmTransferError(path, r.status_code, message)
        answer: dict[str, Any] = r.json()
        return answer

    def init(self) -> None:
        """Open the group: the server's init and this rank's join run together."""
        info = {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size,
                "packed": self.packed, "packed_buffer_size_bytes": self.buffer_size}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.post, "/init_weight_transfer_engine", {"init_info": info})
            try:
                self.group = self._join()
            except BaseException:
                answer.cancel()
                raise
            answer.result()

    def _join(self) -> Any:
        """Rank 0: vLLM's own NCCL rendezvous on CUDA (a vLLM server can be the other side),
        else the gloo group this engine joins on CPU."""
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            return join_vllm_nccl(self.master_address, self.master_port, 0, self.world_size,
                                  device, self.timeout_s)
        return join_update_group(self.master_address, self.master_port, 0, self.world_size,
                                 VLLM_GROUP, self.backend, self.timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
             weight_version: Optional[str] = None, packed: Optional[bool] = None,
             updates: int = 1) -> None:
        """One start .. finish round: the tensors in ``updates`` update_weights calls (split
        evenly, in order), then finish with ``weight_version``. ``packed`` None: the init's."""
        group = self.group
        if group is None:
            raise RuntimeError("VllmWeightSender.send: call init() first")
        named = list(named_tensors)
        with self._lock:
            self.post("/start_weight_update")
            per = max(1, -(-len(named) // max(1, updates)))
            for start in range(0, len(named), per):
                self.update(named[start:start + per], packed)
            body = {"weight_version": weight_version} if weight_version is not None else None
            self.post("/finish_weight_update", body)

    def update(self, named: Sequence[tuple[str, torch.Tensor]],
               packed: Optional[bool] = None) -> None:
        """One update_weights call and its broadcasts (inside a started update)."""
        assert self.group is not None, "call init() first"
        with ThreadPoolExecutor(1) as pool:
            answer: Future = pool.submit(self.post, "/update_weights",
                                         {"update_info": update_info(named, packed)})
            broadcast_weights(self.group, named, self.packed if packed is None else packed,
                              self.buffer_size)
            answer.result()

    def shutdown(self) -> None:
        """Leave the group (the server's side first)."""
        try:
            self.post("/shutdown_weight_transfer_engine")
        finally:
            if self.group is not None:
                self.group.shutdown()
                self.group = None
            self.http.close()
