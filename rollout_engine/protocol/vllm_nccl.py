"""vLLM's NCCL rendezvous for its weight transfer, so either side can be vLLM's own.

vLLM's trainer (``NCCLTrainerWeightTransferEngine.trainer_init``) and its workers meet through
a ``StatelessProcessGroup``: rank 0 hosts a plain TCPStore at ``master_address:master_port``
and publishes the NCCL unique id under the store key of its first object broadcast; every rank
then builds its communicator from that id and runs a one-element float32 all-reduce as a
warm-up before any other collective:

    rank 0:   store (master)  set("broadcast_from/0/0", pickle(ncclUniqueId))
    rank r:   store (client)  get("broadcast_from/0/0") -> the 128 id bytes
    all:      ncclCommInitRank(world_size, id, rank); all_reduce(zeros(1))   # warm-up

The id is pickled as vLLM's ctypes structure (``_ctypes._unpickle`` of
``vllm...pynccl_wrapper.ncclUniqueId`` with its raw bytes): `encode_unique_id` writes exactly
that, and `decode_unique_id` reads it with an unpickler that resolves those two names only,
so no vLLM install is needed on either side and nothing else in the store can run code.
The communicator itself is torch's (``torch.cuda.nccl``); CUDA only.
"""

from __future__ import annotations

import datetime
import io
import pickle
import struct
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["UNIQUE_ID_KEY", "VllmNcclGroup", "decode_unique_id", "encode_unique_id",
           "join_vllm_nccl"]

UNIQUE_ID_BYTES = 128
UNIQUE_ID_KEY = "broadcast_from/0/0"   # StatelessProcessGroup's first broadcast from rank 0
_ID_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"


def encode_unique_id(uid: bytes) -> bytes:
    """The pickle vLLM's rank 0 stores: ``_ctypes._unpickle(ncclUniqueId, ({}, uid))``."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    return (b"\x80\x04" + b"c_ctypes\n_unpickle\n" + f"c{_ID_MODULE}\nncclUniqueId\n".encode()
            + b"}" + b"C" + struct.pack("<B", len(uid)) + uid + b"\x86" + b"\x86" + b"R"
            + b".")


class _IdStructure:
    """Stands for vLLM's ncclUniqueId while unpickling (never instantiated)."""


class _IdUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return _rebuild
        if (module, name) == (_ID_MODULE, "ncclUniqueId"):
            return _IdStructure
        raise pickle.UnpicklingError(f"the NCCL unique id names {module}.{name}, which is not "
                                     "part of vLLM's id")


def _rebuild(cls: Any, state: Any) -> bytes:
    if cls is not _IdStructure or not (isinstance(state, tuple) and len(state) == 2):
        raise pickle.UnpicklingError("not vLLM's NCCL unique id")
    raw = state[1]
    if not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        raise pickle.UnpicklingError(f"the NCCL unique id must hold {UNIQUE_ID_BYTES} bytes")
    return raw


def decode_unique_id(data: bytes) -> bytes:
    """The 128 id bytes of the pickle vLLM's rank 0 stores (UnpicklingError otherwise)."""
    uid = _IdUnpickler(io.BytesIO(data)).load()
    if not isinstance(uid, bytes):
        raise pickle.UnpicklingError("not vLLM's NCCL unique id")
    return uid


class _Done:
    """A broadcast queued on the group's stream: ``wait`` blocks until it has completed."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class VllmNcclGroup:
    """One rank's NCCL communicator of a vLLM weight-transfer group (the ``UpdateGroup``
    interface: ``broadcast`` and ``shutdown``). Broadcasts run on the group's own stream, so
    forwards queued meanwhile on the device's stream never wait for the trainer."""

    def __init__(self, comm: Any, rank: int, world_size: int, device: torch.device,
                 store: Any) -> None:
        self.comm, self.rank, self.world_size = comm, rank, world_size
        self.device, self.store = device, store
        self.group_name, self.backend = "vllm_weight_transfer", "nccl"
        self.stream = torch.cuda.Stream(device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Done:
        if src != 0:
            raise ValueError("vLLM's weight transfer broadcasts from rank 0")
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # tensor written
            torch.cuda.nccl.broadcast([tensor], root=src, streams=[self.stream],
                                      comms=[self.comm])
            tensor.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Done(done)

    def shutdown(self) -> None:
        self.comm = None   # torch destroys the communicator with its last reference
        self.store = None


def join_vllm_nccl(address: str, port: int, rank: int, world_size: int, device: torch.device,
                   timeout_s: float) -> VllmNcclGroup:
    """Take rank ``rank`` of vLLM's weight-transfer group (rank 0 hosts the store and makes
    the id); blocks until every rank has built its communicator and the warm-up ran."""
    if device.type != "cuda":
        raise ValueError("vLLM's NCCL weight transfer needs a CUDA device")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        uid = torch.cuda.nccl.unique_id()
        store.set(UNIQUE_ID_KEY, encode_unique_id(uid))
    else:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        uid = decode_unique_id(store.get(UNIQUE_ID_KEY))
    with torch.cuda.device(device):
        comm = torch.cuda.nccl.init_rank(world_size, uid, rank)
        warm = torch.zeros(1, device=device)   # vLLM's warm-up, before any other collective
        torch.cuda.nccl.all_reduce([warm], comms=[comm])
        torch.cuda.current_stream(device).synchronize()
    return VllmNcclGroup(comm, rank, world_size, device, store)
