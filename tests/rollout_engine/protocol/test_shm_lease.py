"""Lent shared-memory handles (`shm_lease`): the receiver maps the sender's file without taking
or dropping a reference, its mapping outlives the name, and the sender's lease is what keeps
the name; payloads pickled by torch's own reducer keep torch's protocol, and a reader that
refuses one (whole, or part way) still drops the reference it carried for it, exactly once."""

from __future__ import annotations

import gc
import os
import struct

import pytest
import torch

from rollout_engine.protocol.payload_sender import lend_named_tensors
from rollout_engine.protocol.shm_lease import SHM_DIR, ShmLease, open_lent
from rollout_engine.protocol.tensor_payload import (
    UnsafePayloadError,
    deserialize_named_tensors,
    drop_unread_references,
)
from tests.rollout_engine.compat.sglang_fakes import file_system_sharing, mp_serialize


def _path(t: torch.Tensor) -> str:
    return SHM_DIR + t.untyped_storage()._share_filename_cpu_()[1].decode()


def _refcount(path: str) -> int:
    """The shm file's reference count (RefcountedMapAllocator's header: an int at byte 0)."""
    with open(path, "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def test_a_lent_file_is_mapped_without_a_reference_and_outlives_its_name():
    sender = torch.arange(256.0)
    _manager, handle, num_bytes = sender.untyped_storage()._share_filename_cpu_()
    path = SHM_DIR + handle.decode()
    mapped = torch.empty(0).set_(open_lent(handle, num_bytes))   # another mapping of it
    assert mapped.data_ptr() != sender.data_ptr() and _refcount(path) == 1
    sender.mul_(2)                                               # the same memory
    assert torch.equal(mapped, torch.arange(256.0) * 2)
    del sender
    gc.collect()
    assert not os.path.exists(path)        # the sender's was the only reference
    assert torch.equal(mapped, torch.arange(256.0) * 2)   # the mapping is the reader's own
    with pytest.raises(ValueError, match="was the sender's tensor freed"):
        open_lent(handle, num_bytes)
    with pytest.raises(ValueError, match="not one torch creates"):
        open_lent(b"/../etc/passwd", 4)


def test_the_lease_keeps_the_handles_of_tensors_nobody_else_holds():
    text, lease = lend_named_tensors([(f"w{i}", torch.full((64,), float(i))) for i in range(3)])
    assert lease.num_storages == 3
    read = deserialize_named_tensors(text)
    assert [float(t[0]) for _, t in read] == [0.0, 1.0, 2.0]
    paths = [_path(t) for _, t in read]
    del read
    gc.collect()
    assert all(os.path.exists(p) for p in paths)
    lease.release()
    lease.release()                        # once is enough; again is nothing
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)
    with ShmLease() as empty:
        assert empty.num_storages == 0


def test_a_refused_torch_protocol_payload_drops_its_reference_once():
    """SGLang's serializer (torch's reducer) takes a reference for its reader: a reader that
    never reads the payload (the engine asleep) drops it as reading would have."""
    weight = torch.arange(64.0)
    with file_system_sharing():
        text = mp_serialize([("w", weight)], output_str=True)
    path = _path(weight)
    assert _refcount(path) == 2
    assert drop_unread_references(text) == 1
    assert _refcount(path) == 1
    lent, lease = lend_named_tensors([("w", weight)])
    assert drop_unread_references(lent) == 0   # a lent handle carries none
    assert drop_unread_references("%%%") == 0  # nothing can be trusted in garbage
    del weight, lease
    gc.collect()
    assert not os.path.exists(path)


def test_a_torch_protocol_payload_refused_part_way_drops_what_it_did_not_open():
    """The second storage is over the byte cap: the read is refused after admitting the
    first, whose reference is dropped all the same (the one over the cap is never opened)."""
    small, big = torch.zeros(16), torch.zeros(1024)
    with file_system_sharing():
        text = mp_serialize([("small", small), ("big", big)], output_str=True)
    paths = [_path(small), _path(big)]
    assert [_refcount(p) for p in paths] == [2, 2]
    with pytest.raises(UnsafePayloadError, match="cap of 1024"):
        deserialize_named_tensors(text, max_bytes=1024)
    assert [_refcount(p) for p in paths] == [1, 2]
    big.untyped_storage()._shared_decref()   # what was never admitted is the sender's to drop
    del small, big
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)
