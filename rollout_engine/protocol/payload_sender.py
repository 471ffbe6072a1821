"""The sender's end of a tensor payload: tensors pickled as handles, base64 encoded, and lent.

    lend_named_tensors(obj) -> (base64 str, ShmLease)
      CPU tensor  -> moved to POSIX shm in place, lent by shm file name (shm_lease.py)
      CUDA tensor -> CUDA IPC handle

No tensor bytes travel in the string, so the receiver (tensor_payload.py) sees the sender's
memory, not a copy. No shared-memory reference travels either: the `ShmLease` owns them until
the call is answered, so a refused, cancelled or failed call leaks nothing. A repeat of the same
handles reuses its string (`payload_cache.SentPayloads`).
"""

from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions  # noqa: F401 - registers torch's reducers

from rollout_engine.protocol.payload_cache import SentPayloads, recording
from rollout_engine.protocol.shm_lease import ShmLease, lend_storage, rebuild_lent_storage

__all__ = ["lend_named_tensors", "serialize_named_tensors"]

_PROTOCOL = 4

_SENT = SentPayloads()


def _lend_storage(storage: torch.UntypedStorage):
    """A CPU storage as a lent handle: moved into POSIX shared memory in place (like
    `Tensor.share_memory_()`, torch's "file_system" strategy without changing the global
    strategy) and sent by a name any process on the host can open, unlike the
    "file_descriptor" strategy's fd. No shm reference is taken: the sender's lease holds the
    storage until the call is answered."""
    return (rebuild_lent_storage, lend_storage(storage))


def lend_named_tensors(payload: object) -> tuple[str, ShmLease]:
    """Pickle `payload` with tensors as handles and base64 encode it; the lease holds every
    CPU storage the string names. Release it once the receiver answered (any answer), failed
    or timed out: until then the handles can be opened even if the caller drops its tensors.

    `payload` is any nesting of list/tuple/dict/OrderedDict/str/int/float/bool/None/bytes,
    torch.Tensor (or Parameter), TensorMeta and FlattenedBucket; the receiver refuses anything
    else. CPU tensors are moved into shared memory *in place* and lent by file name; CUDA
    tensors are sent as CUDA IPC handles (receivable only by another process). The
    process-global sharing strategy is left untouched: this pickler overrides the storage
    reducer on its own dispatch table instead of calling `set_sharing_strategy("file_system")`.

    Do not modify the tensors until the receiver answered (CUDA IPC also requires the
    producer's memory to outlive every consumer). A string may be read any number of times,
    by any number of processes, while its storages live. A list of (name, tensor) pairs whose
    every view and storage were serialized before gives the same string again without
    pickling (`payload_cache.SentPayloads`).
    """
    key = SentPayloads.key(payload)
    if key is not None:
        cached = _SENT.get(key)
        if cached is not None:
            text, storages = cached
            return text, ShmLease(storages)
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, _PROTOCOL)
    shared: list[torch.UntypedStorage] = []
    pickler.dispatch_table[torch.UntypedStorage] = recording(_lend_storage, shared)
    pickler.dump(payload)
    text = base64.b64encode(buf.getvalue()).decode("ascii")
    if key is not None:
        _SENT.put(key, text, shared)
    return text, ShmLease(shared)


def serialize_named_tensors(payload: object) -> str:
    """`lend_named_tensors` without the lease: the caller keeps the tensors alive (and
    unmodified) until the receiver answered, which keeps their shm files named."""
    return lend_named_tensors(payload)[0]
