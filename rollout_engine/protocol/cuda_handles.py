"""Vetted reconstructor for CUDA tensor handles (`rebuild_cuda_tensor`, and SGLang's variant).

The sender's allocation is opened through CUDA IPC only after every argument was checked: tensor
inside the claimed storage, storage within the payload's byte budget, a local device (SGLang
sends its uuid), and a ref-counter file of the form torch creates, with the offset inside it.
Once opened, the claimed storage size is compared with the allocation's real range.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.multiprocessing import reductions

from rollout_engine.protocol.payload_checks import (
    PayloadBudget,
    UnsafePayloadError,
    as_bytes,
    check_dtype,
    check_layout,
    is_int,
    shm_file_bytes,
)
from rollout_engine.protocol.tensor_handles import (
    Lazy,
    ReadContext,
    Reconstructor,
    storage_token,
    tensor_token,
)

__all__ = ["CUDA_RECONSTRUCTORS", "CudaTensor", "bind_cuda_device", "check_cuda_tensor_args",
           "rebuild_cuda_tensor_args"]

_MAX_HANDLE_BYTES = 256  # CUDA IPC memory/event handles are 64 bytes (cudaIpc*Handle_t)
_REF_COUNTER_BYTES = 8  # int64 counters in the CUDA IPC ref-counter file


class CudaTensor(Lazy):
    """`rebuild_cuda_tensor`'s 15 arguments, vetted; `device` resolved to a local index."""

    def __init__(self, args: list[Any]) -> None:
        self.args = args

    def materialize(self, ctx, convert):
        t = reductions.rebuild_cuda_tensor(*self.args)
        _check_cuda_allocation(t.untyped_storage(), self.args[8])
        return t


def _cuda_device_index(device: Any, what: str) -> int:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UnsafePayloadError(f"{what}: the payload holds a CUDA tensor but this receiver "
                                 "has no CUDA device")
    if is_int(device) and 0 <= device < count:
        return device
    if isinstance(device, str):  # SGLang's patched reductions send the device's UUID
        for index in range(count):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise UnsafePayloadError(f"{what}: no local CUDA device has uuid {device!r}")
    raise UnsafePayloadError(f"{what}: device must be an index below {count} or a uuid, "
                             f"got {device!r}")


def check_cuda_tensor_args(budget: PayloadBudget, args: Any, what: str) -> list[Any]:
    """Vet `rebuild_cuda_tensor`'s 15 arguments as plain values and charge their storage to
    `budget`: everything but the device and the ref-counter file (`bind_cuda_device`), so a
    receiver without CUDA can check them too. Returns them as a list."""
    if not isinstance(args, (tuple, list)) or len(args) != 15:
        got = len(args) if isinstance(args, (tuple, list)) else type(args).__name__
        raise UnsafePayloadError(f"{what}: expected 15 arguments (rebuild_cuda_tensor's), "
                                 f"got {got}")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
     storage_offset_bytes, requires_grad, ref_handle, ref_offset, event_handle,
     event_sync) = args
    tensor_token(tensor_cls, what)
    storage_token(storage_cls, what)
    dtype = check_dtype(dtype, what)
    for value, name in ((storage_bytes, "storage size"), (storage_offset_bytes, "storage offset"),
                        (ref_offset, "ref-counter offset")):
        if not is_int(value) or value < 0:
            raise UnsafePayloadError(f"{what}: {name} must be a non-negative int, got {value!r}")
    if not isinstance(requires_grad, bool) or not isinstance(event_sync, bool):
        raise UnsafePayloadError(f"{what}: requires_grad and event_sync_required must be bools")
    check_layout(size, stride, offset, dtype, storage_bytes, what)
    for value, name in ((handle, "IPC memory handle"), (event_handle, "IPC event handle")):
        if value is not None and not (isinstance(value, bytes)
                                      and len(value) <= _MAX_HANDLE_BYTES):
            raise UnsafePayloadError(f"{what}: {name} must be bytes, got {value!r}")
    if handle is not None and storage_bytes:
        as_bytes(ref_handle, f"{what}: ref counter")
    budget.charge(("cuda", handle, storage_offset_bytes), storage_bytes, "CUDA IPC storage")
    return list(args)


def bind_cuda_device(args: list[Any], device_index: int, what: str) -> CudaTensor:
    """Vetted arguments (`check_cuda_tensor_args`) bound to local CUDA device `device_index`,
    once their ref-counter file was checked (it exists, the offset inside it): a descriptor
    that opens the handle when materialized."""
    handle, storage_bytes, ref_handle, ref_offset = args[7], args[8], args[11], args[12]
    if handle is not None and storage_bytes:
        ref_bytes = shm_file_bytes(as_bytes(ref_handle, f"{what}: ref counter"), what)
        if (ref_offset + 1) * _REF_COUNTER_BYTES > ref_bytes:
            raise UnsafePayloadError(f"{what}: ref-counter offset {ref_offset} is outside its "
                                     "shared-memory file")
    out = list(args)
    out[0], out[4] = args[0].cls, args[4].cls   # the classes the vetted tokens name
    out[6] = device_index
    return CudaTensor(out)


def rebuild_cuda_tensor_args(ctx: ReadContext, args: tuple, what: str) -> CudaTensor:
    """Vet `rebuild_cuda_tensor`'s arguments (also SGLang's uuid-device variant)."""
    checked = check_cuda_tensor_args(ctx.budget, args, what)
    return bind_cuda_device(checked, _cuda_device_index(checked[6], what), what)


def _rebuild_cuda_tensor(ctx: ReadContext, *args: Any) -> CudaTensor:
    return rebuild_cuda_tensor_args(ctx, args, "rebuild_cuda_tensor")


def _check_cuda_allocation(storage: torch.UntypedStorage, storage_bytes: int) -> None:
    """Refuse a CUDA IPC storage that claims more bytes than the sender's allocation holds.

    Best effort: asks the driver for the allocation's range; skipped when it cannot answer."""
    if not storage_bytes:
        return
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        base, length = ctypes.c_uint64(), ctypes.c_size_t()
        rc = libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(length),
                                             ctypes.c_uint64(storage.data_ptr()))
    except (OSError, AttributeError):
        return
    if rc == 0 and storage.data_ptr() + storage_bytes > base.value + length.value:
        raise UnsafePayloadError(
            f"CUDA IPC storage claims {storage_bytes} bytes but the sender's allocation ends "
            f"{base.value + length.value - storage.data_ptr()} bytes after it"
        )


_R = "torch.multiprocessing.reductions"

CUDA_RECONSTRUCTORS: dict[tuple[str, str], Any] = {
    (_R, "rebuild_cuda_tensor"): Reconstructor(f"{_R}.rebuild_cuda_tensor", _rebuild_cuda_tensor),
}
