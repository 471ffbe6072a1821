"""Hostile tensor payloads: every hole of the old unpickler is refused before anything is mapped.

Pickles are built with `_Call`, whose reduction names real torch functions and classes, exactly
what a crafted payload can do; plain `pickle` would execute them (see the control tests).
"""

import base64
import os
import pickle
import socket
import tempfile

import pytest
import torch
from torch.multiprocessing import reductions

from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.protocol.tensor_payload import UnsafePayloadError, deserialize_named_tensors

R = reductions
SHM_DIR = "/dev/shm"


class _Call:
    """Pickles as func(*args), then optional BUILD(state) / SETITEMS(items) / APPENDS(items)."""

    def __init__(self, func, *args, state=None, listitems=None, dictitems=None):
        self.func, self.args = func, args
        self.state, self.listitems, self.dictitems = state, listitems, dictitems

    def __reduce__(self):
        return (self.func, self.args, self.state,
                None if self.listitems is None else iter(self.listitems),
                None if self.dictitems is None else iter(self.dictitems))


def _b64(obj) -> str:
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode()


def _shared(tensor: torch.Tensor) -> tuple[bytes, bytes, int]:
    """(manager socket, shm name, bytes) of `tensor`'s storage, moved into shared memory.

    Holds one shm reference for the one read a test makes (as serialize_named_tensors does)."""
    storage = tensor.untyped_storage()
    handle = storage._share_filename_cpu_()
    storage._shared_incref()
    return handle


def _storage(manager, name, size):
    return _Call(R.rebuild_storage_filename, torch.UntypedStorage, manager, name, size)


def _tensor(storage, dtype=torch.float32, size=(4,), stride=(1,), offset=0, **extra):
    typed = _Call(R.rebuild_typed_storage, storage, dtype)
    return _Call(R.rebuild_tensor, torch.Tensor, typed,
                 (offset, torch.Size(size), stride, False), **extra)


@pytest.fixture
def victim():
    """A sender's float32 tensor of 4 elements in shared memory, and its handle."""
    tensor = torch.arange(1.0, 5.0)
    manager, name, size = _shared(tensor)
    return tensor, manager, name, size


def _shm_size(name: bytes) -> int:
    return os.stat(os.path.join(SHM_DIR, name.decode()[1:])).st_size


def test_well_formed_handle_is_accepted(victim):
    """The crafted pickles below are real payloads: the same one, unmodified, is read."""
    tensor, manager, name, size = victim
    out = deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, name, size)))]))
    assert torch.equal(out[0][1], tensor)


# ---- allocation bounds ----------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    _Call(torch.UntypedStorage, 1 << 20),
    _Call(torch.UntypedStorage, 1 << 45),
    _Call(torch.Tensor, 1 << 20),
    _Call(torch.storage.TypedStorage, 1 << 20),
    _Call(torch.nn.Parameter, _Call(torch.Tensor, 1 << 20)),
])
def test_direct_class_calls_are_refused(call):
    """Before: a 40-byte payload calling UntypedStorage(1 << 20) allocated 1 MiB."""
    with pytest.raises(UnsafePayloadError, match="opcode REDUCE on torch"):
        deserialize_named_tensors(_b64([("w", call)]))


def test_newobj_cannot_allocate_tensors():
    # PROTO 2, GLOBAL torch.Tensor, BININT 1 << 20, TUPLE1, NEWOBJ: Tensor.__new__(1 << 20)
    raw = b"\x80\x02ctorch\nTensor\nJ\x00\x00\x10\x00\x85\x81."
    assert pickle.loads(raw).numel() == 1 << 20  # control: plain pickle allocates
    with pytest.raises(UnsafePayloadError, match="opcode NEWOBJ on torch.Tensor"):
        deserialize_named_tensors(base64.b64encode(raw).decode())


def test_storage_larger_than_its_shm_file_is_refused_and_nothing_grows(victim):
    """Before: opening a 16-byte shm file as 1 MiB ftruncate()d it to 1 MiB."""
    _, manager, name, _ = victim
    before = _shm_size(name)
    payload = _b64([("w", _tensor(_storage(manager, name, 1 << 20), size=(1 << 18,)))])
    with pytest.raises(UnsafePayloadError, match="holds 16; opening it would grow it"):
        deserialize_named_tensors(payload)
    assert _shm_size(name) == before


def test_storage_over_the_payload_cap_is_refused(victim):
    _, manager, name, _ = victim
    with pytest.raises(UnsafePayloadError, match="over this receiver's cap of 68719476736"):
        deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, name, 1 << 40)))]))


def test_total_payload_cap_counts_every_storage_once():
    tensors = [(f"w{i}", torch.zeros(256)) for i in range(4)]  # 1 KiB each
    payload = serialize_named_tensors(tensors)
    assert len(deserialize_named_tensors(payload, max_bytes=4096)) == 4
    with pytest.raises(UnsafePayloadError, match="5120 bytes of storage .* cap of 4096"):
        deserialize_named_tensors(serialize_named_tensors(tensors + [("x", torch.zeros(256))]),
                                  max_bytes=4096)
    shared = torch.zeros(256)  # two views of one storage cost its bytes once
    views = serialize_named_tensors([("a", shared[:128]), ("b", shared[128:])])
    assert len(deserialize_named_tensors(views, max_bytes=1024)) == 2


@pytest.mark.parametrize(("size", "stride", "offset", "message"), [
    ((5,), (1,), 0, "needs 20 bytes but its storage has only 16"),
    ((4,), (1,), 1, "needs 20 bytes"),
    ((2, 2), (4, 1), 0, "needs 24 bytes"),
    ((1 << 40,), (1,), 0, "needs 4398046511104 bytes"),
    ((4,), (1,), -1, "do not describe a tensor"),
    ((4,), (-1,), 3, "non-negative ints"),
    ((4,), (1, 1), 0, "do not describe a tensor"),
])
def test_tensor_larger_than_its_storage_is_refused(victim, size, stride, offset, message):
    _, manager, name, nbytes = victim
    payload = _b64([("w", _tensor(_storage(manager, name, nbytes), size=size, stride=stride,
                                  offset=offset))])
    with pytest.raises(UnsafePayloadError, match=message):
        deserialize_named_tensors(payload)


def test_in_process_cache_is_checked_against_the_real_storage(victim):
    """Claiming fewer bytes than the sender's storage is fine; the tensor is still in bounds."""
    _, manager, name, _ = victim
    out = deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, name, 8), size=(2,)))]))
    assert out[0][1].tolist() == [1.0, 2.0]


# ---- mutation -------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "opcode"), [
    ({"dictitems": [(0, 99.0)]}, "SETITEM"),
    ({"dictitems": [(0, 99.0), (1, 98.0)]}, "SETITEMS"),
    ({"listitems": [99.0]}, "APPEND"),
    ({"listitems": [99.0, 98.0]}, "APPENDS"),
    ({"state": {"data": 0}}, "BUILD"),
])
def test_payload_cannot_write_into_a_tensor(victim, extra, opcode):
    """Before: SETITEM on a rebuilt tensor wrote into the sender's shared memory."""
    tensor, manager, name, size = victim
    payload = _b64([("w", _tensor(_storage(manager, name, size), **extra))])
    with pytest.raises(UnsafePayloadError, match=f"opcode {opcode} on a CpuTensor"):
        deserialize_named_tensors(payload)
    assert tensor.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_control_plain_pickle_writes_into_the_tensor(victim):
    """Without the restriction the SETITEM payload above does write (so that test can fail)."""
    tensor, manager, name, size = victim
    obj = pickle.loads(pickle.dumps(_tensor(_storage(manager, name, size),
                                            dictitems=[(0, 99.0)]), protocol=4))
    assert tensor[0].item() == 99.0 and obj[0].item() == 99.0


@pytest.mark.parametrize("target", [torch.Tensor, torch.Size, torch.float32])
def test_payload_cannot_write_into_classes_or_dtypes(target):
    glob = pickle.dumps(target, protocol=2)[:-1]  # PROTO 2, GLOBAL module name, BINPUT
    payload = glob + b"X\x01\x00\x00\x00xK\x01s."  # key "x", value 1, SETITEM, STOP
    with pytest.raises(UnsafePayloadError, match="opcode SETITEM"):
        deserialize_named_tensors(base64.b64encode(payload).decode())
    assert not hasattr(torch.Tensor, "x")


# ---- shared-memory names and manager sockets ------------------------------------------------


@pytest.mark.parametrize("name", [
    b"/dev/shm/../etc/passwd",
    b"/etc/passwd",
    b"../../etc/passwd",
    b"/torch_1_2_3/../../etc/passwd",
    b"torch_1_2_3",
    b"/torch_1_2",
    b"/torch_a_2_3",
    b"/nottorch_1_2_3",
    b"/torch_1_2_3\x00",
    b"/psm_deadbeef",
])
def test_shm_names_of_other_forms_are_refused(victim, name):
    _, manager, _, _ = victim
    with pytest.raises(UnsafePayloadError, match="is not one torch creates"):
        deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, name, 16)))]))


def test_shm_name_of_torch_form_must_exist_as_a_regular_file(victim):
    _, manager, _, _ = victim
    with pytest.raises(UnsafePayloadError, match="does not exist"):
        deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, b"/torch_1_2_3", 16)))]))
    directory = os.path.join(SHM_DIR, f"torch_{os.getpid()}_7_7")
    os.mkdir(directory)
    try:
        with pytest.raises(UnsafePayloadError, match="is not a regular file"):
            deserialize_named_tensors(_b64([("w", _tensor(_storage(
                manager, f"/torch_{os.getpid()}_7_7".encode(), 16)))]))
    finally:
        os.rmdir(directory)


@pytest.mark.parametrize("manager", [
    b"/tmp/evil.sock",
    b"/tmp/torch-shm-dir-abc/manager.sock",
    b"/tmp/torch-shm-dir-abcdef/other.sock",
    b"/tmp/torch-shm-dir-abcdef/../torch-shm-dir-abcdef/manager.sock",
    b"/tmp/x/../torch-shm-dir-abcdef/manager.sock",
    b"tmp/torch-shm-dir-abcdef/manager.sock",
    b"/tmp//torch-shm-dir-abcdef/manager.sock",
    b"@abstract/torch-shm-dir-abcdef/manager.sock",
])
def test_manager_sockets_of_other_forms_are_refused(victim, manager):
    _, _, name, size = victim
    with pytest.raises(UnsafePayloadError, match="is not one torch creates"):
        deserialize_named_tensors(_b64([("w", _tensor(_storage(manager, name, size)))]))


def test_manager_socket_of_torch_form_must_be_a_live_socket(victim):
    _, _, name, size = victim
    with tempfile.TemporaryDirectory() as tmp:
        fake_dir = os.path.join(tmp, "torch-shm-dir-AbC123")
        os.mkdir(fake_dir)
        path = os.path.join(fake_dir, "manager.sock")
        open(path, "w").close()  # a regular file, not a socket
        with pytest.raises(UnsafePayloadError, match="does not exist"):
            deserialize_named_tensors(_b64([("w", _tensor(_storage(path.encode(), name, size)))]))
        os.unlink(path)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path)  # a socket of the form passes; torch then finds no manager on it
            with pytest.raises(ValueError, match="could not rebuild.*Connection refused"):
                deserialize_named_tensors(_b64(_tensor(_storage(path.encode(), name, size))))


# ---- other shapes of abuse ------------------------------------------------------------------


def test_default_sharing_strategy_gets_a_hint():
    import io
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")   # torch's Linux default
    try:
        ForkingPickler(buf, 4).dump([("w", torch.ones(3))])
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    with pytest.raises(UnsafePayloadError, match=r"set_sharing_strategy\('file_system'\)"):
        deserialize_named_tensors(base64.b64encode(buf.getvalue()).decode())


@pytest.mark.parametrize("value", [torch.Tensor, torch.UntypedStorage, R.rebuild_tensor])
def test_bare_classes_and_functions_are_not_values(value):
    with pytest.raises(UnsafePayloadError, match="as a value"):
        deserialize_named_tensors(_b64({"x": value}))


def test_bare_storage_is_not_a_value(victim):
    _, manager, name, size = victim
    with pytest.raises(UnsafePayloadError, match="bare storage"):
        deserialize_named_tensors(_b64([_storage(manager, name, size)]))


@pytest.mark.parametrize(("call", "message"), [
    (_Call(R.rebuild_tensor, torch.Size, None, (0, (1,), (1,), False)), "tensor class"),
    (_Call(R.rebuild_storage_filename, torch.Tensor, b"m", b"n", 1), "storage class"),
    (_Call(R.rebuild_typed_storage, b"not a storage", torch.float32), "expected a shared"),
    (_Call(R.rebuild_cuda_tensor, *([None] * 14)), "expected 15 arguments"),
    (_Call(torch.Size, ((1 << 70),) * 65), "torch.Size"),
])
def test_reconstructors_check_their_arguments(call, message):
    with pytest.raises(UnsafePayloadError, match=message):
        deserialize_named_tensors(_b64(call))


def test_cuda_handle_without_cuda_is_refused_before_opening():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    args = [torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.float32,
            0, b"\x00" * 64, 16, 0, False, b"/torch_1_2_3", 0, b"\x00" * 64, True]
    with pytest.raises(UnsafePayloadError, match="has no CUDA device"):
        deserialize_named_tensors(_b64(_Call(R.rebuild_cuda_tensor, *args)))
    args[8] = 1 << 50  # an oversized IPC storage is refused by the cap first
    with pytest.raises(UnsafePayloadError, match="cap"):
        deserialize_named_tensors(_b64(_Call(R.rebuild_cuda_tensor, *args)))
