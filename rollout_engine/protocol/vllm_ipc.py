"""vLLM's ``ipc`` weight-transfer backend on the wire: its init_info, its update_info, and the CUDA
IPC handles in it, every one checked before anything is opened.

    init_weight_transfer_engine {"init_info": {"packed"?: bool}}
        an init_info without the rendezvous fields (master_address, master_port, rank_offset,
        world_size) is the ipc backend's: a trainer on this machine's GPUs, no group to join
    update_weights {"update_info": {names, dtype_names, shapes,
                                    ipc_handles_pickled | ipc_handles, tensor_sizes?}}

The handles are ``rebuild_cuda_tensor``'s 15 arguments (what torch's ``reduce_tensor`` returns
for a CUDA tensor) keyed by the physical GPU's UUID, as vLLM's trainer builds them:

    unpacked   ipc_handles = [{uuid: args}, ...]       one per name, the tensor itself
    packed     ipc_handles = {uuid: args}              one uint8 buffer; tensor_sizes[i] bytes
                                                       of tensor i, back to back from byte 0

``ipc_handles_pickled`` is that object pickled and base64 encoded (vLLM's HTTP client sends
this). It is read by the restricted unpickler (restricted_unpickler.py) with a narrower set of
globals: the arguments hold only torch's tensor / storage classes (as tokens that cannot be
called), dtypes, ``torch.Size``, bytes and numbers, inside dicts, lists and tuples; any other
global (os.system, builtins.eval, a rebuild function, ...) is refused before it resolves. The
text is bounded by the number of tensors it describes, and each GPU's storages by a byte cap.

JSON ``ipc_handles`` are checked for the same shape and then refused: JSON cannot hold the
classes and bytes of the arguments (vLLM itself pickles them for HTTP).

Opening a handle needs CUDA on this side: ``rebuild`` picks this device's UUID, checks the
ref-counter file and opens the handles (cuda_handles.py). Everything else runs on any device,
so a CPU engine reports a malformed update as malformed before it says it needs CUDA.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.protocol.cuda_handles import bind_cuda_device, check_cuda_tensor_args
from rollout_engine.protocol.payload_checks import PayloadBudget, UnsafePayloadError
from rollout_engine.protocol.restricted_unpickler import (
    GLOBALS,
    RestrictedUnpickler,
    check_opcodes,
    describe,
)
from rollout_engine.protocol.tensor_handles import ReadContext
from rollout_engine.protocol.vllm_wire import tensor_list, worker_entry

__all__ = [
    "IPC_INIT_FIELDS",
    "IPC_UPDATE_FIELDS",
    "IpcInit",
    "IpcUpdate",
    "RENDEZVOUS_FIELDS",
    "is_ipc_init_info",
    "max_pickled_chars",
    "parse_ipc_init_info",
    "parse_ipc_update_info",
    "rebuild",
]

RENDEZVOUS_FIELDS = ("master_address", "master_port", "rank_offset", "world_size",
                     "nccl_unique_id_b64")
IPC_INIT_FIELDS = ("packed",)
IPC_UPDATE_FIELDS = ("names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled",
                     "tensor_sizes")
MAX_GPUS = 64                 # UUID entries one handle dict may hold
_BASE_CHARS = 64 << 10        # the pickled text: this much, plus _CHARS_PER_TENSOR a tensor
_CHARS_PER_TENSOR = 8 << 10   # ~400 B of arguments per GPU entry, base64 (x4/3), room to spare

Handles = dict[str, list[Any]]   # GPU uuid -> checked rebuild_cuda_tensor arguments


@dataclass(frozen=True)
class IpcInit:
    """A checked ipc ``init_info``: whether updates carry one packed buffer."""

    packed: bool = False


@dataclass(frozen=True)
class IpcUpdate:
    """A checked ipc ``update_info``: the tensors, in order, and the handles they come from
    (``handles[i]`` tensor i's when unpacked; ``handles[0]`` the buffer when packed, tensor i
    its ``tensor_sizes[i]`` bytes at ``offsets[i]``)."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    handles: list[Handles]
    tensor_sizes: Optional[list[int]] = None

    @property
    def packed(self) -> bool:
        return self.tensor_sizes is not None

    def offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.tensor_sizes or ():
            out.append(at)
            at += n
        return out


def is_ipc_init_info(info: Any) -> bool:
    """Whether ``init_info`` is the ipc backend's: an object naming no rendezvous field."""
    return isinstance(info, dict) and not any(k in info for k in RENDEZVOUS_FIELDS)


def parse_ipc_init_info(info: Any) -> IpcInit:
    """Check an ipc ``init_info`` (ValueError naming the field)."""
    if not isinstance(info, dict):
        raise ValueError(f"init_info: must be an object, got {type(info).__name__}")
    unknown = sorted(set(info) - set(IPC_INIT_FIELDS))
    if unknown:
        raise ValueError(f"init_info: unknown field(s) {unknown}; the ipc backend takes "
                         f"{list(IPC_INIT_FIELDS)}, the nccl backend master_address, "
                         "master_port, rank_offset and world_size")
    packed = info.get("packed", False)
    if not isinstance(packed, bool):
        raise ValueError(f"init_info.packed: must be true or false, got {packed!r}")
    return IpcInit(packed)


def max_pickled_chars(num_tensors: int) -> int:
    """The longest ``ipc_handles_pickled`` accepted for an update of ``num_tensors``."""
    return _BASE_CHARS + _CHARS_PER_TENSOR * max(num_tensors, 1)


def parse_ipc_update_info(info: Any, init: IpcInit, max_bytes: int,
                          worker_rank: int = 0) -> IpcUpdate:
    """Check an ipc ``update_info`` and every handle in it; nothing is opened. ``max_bytes``
    caps the storage bytes of one GPU's handles. ValueError (UnsafePayloadError for what the
    handles may not hold) naming the field."""
    info = worker_entry(info, worker_rank)
    unknown = sorted(set(info) - set(IPC_UPDATE_FIELDS))
    if unknown:
        raise ValueError(f"update_info: unknown field(s) {unknown}; the ipc backend's fields "
                         f"are {list(IPC_UPDATE_FIELDS)} (packed is set at init)")
    names, dtypes, shapes = tensor_list(info)
    pickled, plain = info.get("ipc_handles_pickled"), info.get("ipc_handles")
    if (pickled is None) == (plain is None):
        raise ValueError("update_info: give exactly one of ipc_handles_pickled (base64 pickle, "
                         "as vLLM's HTTP client sends) or ipc_handles, got "
                         f"{'both' if pickled is not None else 'neither'}")
    sizes = _tensor_sizes(info.get("tensor_sizes"), init.packed, dtypes, shapes)
    if pickled is not None:
        raw = _read_pickled(pickled, len(names), max_bytes)
        where = "ipc_handles_pickled"
    else:
        raw, where = plain, "ipc_handles"
    handles = _handle_dicts(raw, init.packed, len(names), max_bytes, where,
                            from_json=plain is not None)
    if plain is not None:
        raise ValueError("update_info.ipc_handles: rebuild_cuda_tensor's arguments hold "
                         "classes and bytes, which JSON cannot carry; send them pickled in "
                         "ipc_handles_pickled, as vLLM's HTTP client does")
    update = IpcUpdate(names, dtypes, shapes, handles, sizes)
    _check_against_declared(update, where)
    return update


def _tensor_sizes(value: Any, packed: bool, dtypes: list[torch.dtype],
                  shapes: list[tuple[int, ...]]) -> Optional[list[int]]:
    if not packed:
        if value is not None and not isinstance(value, list):
            raise ValueError(f"update_info.tensor_sizes: must be a list, got "
                             f"{type(value).__name__}")
        return None   # vLLM's receiver ignores it unpacked
    if value is None:
        raise ValueError("update_info.tensor_sizes: required when the transfer is packed "
                         "(init_info.packed)")
    if not isinstance(value, list) or len(value) != len(shapes):
        raise ValueError(f"update_info.tensor_sizes: must be a list of {len(shapes)} byte "
                         f"counts, one per name, got {value!r:.200}")
    for i, (n, d, s) in enumerate(zip(value, dtypes, shapes)):
        want = math.prod(s) * d.itemsize
        if not isinstance(n, int) or isinstance(n, bool) or n != want:
            raise ValueError(f"update_info.tensor_sizes[{i}]: a {d} tensor of shape {list(s)} "
                             f"is {want} bytes, got {n!r}")
    return list(value)


class _HandleUnpickler(RestrictedUnpickler):
    """The restricted unpickler, admitting only the globals rebuild_cuda_tensor's arguments
    hold (every other global is refused by name before it resolves)."""

    ADMITTED = {k: GLOBALS[k] for k in (
        ("torch", "Size"), ("torch", "Tensor"), ("torch._tensor", "Tensor"),
        ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
        ("torch", "UntypedStorage"), ("torch.storage", "TypedStorage"))}

    def find_class(self, module: str, name: str) -> Any:
        found = self.ADMITTED.get((module, name))
        if found is None and module == "torch":
            dtype = getattr(torch, name, None)
            found = dtype if isinstance(dtype, torch.dtype) else None
        if found is None:
            raise UnsafePayloadError(
                f"ipc_handles_pickled refers to {module}.{name}, which is not allowed: it may "
                "hold only rebuild_cuda_tensor's arguments (torch's tensor and storage "
                "classes, dtypes, sizes, bytes and numbers) in dicts, lists and tuples")
        return found


def _read_pickled(text: Any, num_tensors: int, max_bytes: int) -> Any:
    if not isinstance(text, str):
        raise ValueError(f"update_info.ipc_handles_pickled: must be a base64 string, got "
                         f"{type(text).__name__}")
    limit = max_pickled_chars(num_tensors)
    if len(text) > limit:
        raise ValueError(f"update_info.ipc_handles_pickled: {len(text)} characters is over the "
                         f"{limit} accepted for {num_tensors} tensor(s)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"update_info.ipc_handles_pickled: not valid base64: {e}") from e
    try:
        check_opcodes(data)
    except UnsafePayloadError as e:
        raise UnsafePayloadError(f"update_info.ipc_handles_pickled: {e}") from e
    except ValueError as e:
        raise ValueError(f"update_info.ipc_handles_pickled: {e}") from e

    def no_nesting(data: Any, ctx: ReadContext) -> Any:
        raise UnsafePayloadError("ipc_handles_pickled may not nest payloads")

    ctx = ReadContext(PayloadBudget(max_bytes), 0, 0, no_nesting)
    try:
        return _HandleUnpickler(io.BytesIO(data), ctx).load()
    except UnsafePayloadError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle, whatever pickle raised
        raise ValueError(f"update_info.ipc_handles_pickled: not a pickle of IPC handles: "
                         f"{type(e).__name__}: {e}") from e


def _handle_dicts(raw: Any, packed: bool, num_tensors: int, max_bytes: int, where: str,
                  from_json: bool) -> list[Handles]:
    """``raw`` in the shape the init's ``packed`` asks for, every entry's arguments checked
    (``from_json``: arguments as JSON can give them are left for the caller to refuse); each
    GPU's storages charged to a budget of its own."""
    if packed:
        if not isinstance(raw, dict):
            raise ValueError(f"update_info.{where}: a packed transfer (init_info.packed) sends "
                             f"one {{gpu_uuid: args}} object for its buffer, got {describe(raw)}")
        entries = [raw]
    else:
        if not isinstance(raw, list) or len(raw) != num_tensors:
            got = f"{len(raw)} entries" if isinstance(raw, list) else describe(raw)
            raise ValueError(f"update_info.{where}: an unpacked transfer sends a list of "
                             f"{num_tensors} {{gpu_uuid: args}} objects, one per name, "
                             f"got {got}")
        entries = raw
    budgets: dict[str, PayloadBudget] = {}
    out: list[Handles] = []
    for i, entry in enumerate(entries):
        at = where if packed else f"{where}[{i}]"
        if not isinstance(entry, dict) or not 0 < len(entry) <= MAX_GPUS:
            raise ValueError(f"update_info.{at}: must map 1 to {MAX_GPUS} GPU uuids to "
                             f"rebuild_cuda_tensor's arguments, got {describe(entry)}"
                             + (f" of {len(entry)}" if isinstance(entry, dict) else ""))
        checked: Handles = {}
        for uuid, args in entry.items():
            if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
                raise ValueError(f"update_info.{at}: keys must be GPU uuid strings, got "
                                 f"{describe(uuid)}")
            if not isinstance(args, (tuple, list)):
                raise ValueError(f"update_info.{at}[{uuid!r}]: must be rebuild_cuda_tensor's "
                                 f"arguments, got {describe(args)}")
            if from_json and plain_json(args):
                checked[uuid] = list(args)   # refused after the shape checks
                continue
            budget = budgets.setdefault(uuid, PayloadBudget(max_bytes))
            checked[uuid] = check_cuda_tensor_args(budget, args, f"update_info.{at}[{uuid!r}]")
        out.append(checked)
    return out


def plain_json(args: Any) -> bool:
    """Arguments as JSON gives them (strings and numbers where classes and bytes belong)."""
    return isinstance(args, list) and len(args) == 15 and all(
        a is None or isinstance(a, (str, int, float, bool, list)) for a in args)


def _check_against_declared(update: IpcUpdate, where: str) -> None:
    """Each handle describes what names / dtype_names / shapes (tensor_sizes) declare."""
    for i, entry in enumerate(update.handles):
        for uuid, args in entry.items():
            size, dtype = tuple(args[1]), args[5]
            at = f"update_info.{where}" + ("" if update.packed else f"[{i}]") + f"[{uuid!r}]"
            if update.packed:
                need = sum(update.tensor_sizes or ())
                if dtype != torch.uint8 or len(size) != 1 or size[0] < need:
                    raise ValueError(f"{at}: the packed buffer must be a uint8 vector of at "
                                     f"least {need} bytes (the sum of tensor_sizes), got "
                                     f"{dtype} of shape {list(size)}")
            elif size != update.shapes[i] or dtype != update.dtypes[i]:
                raise ValueError(f"{at}: the handle is a {dtype} tensor of shape {list(size)}, "
                                 f"but {update.names[i]!r} is declared {update.dtypes[i]} of "
                                 f"shape {list(update.shapes[i])}")


def rebuild(update: IpcUpdate, device: torch.device,
            opened: Optional[dict[tuple, torch.Tensor]] = None
            ) -> list[tuple[str, torch.Tensor]]:
    """Open ``update``'s handles on CUDA ``device`` (its UUID's entries): unpacked, each name's
    tensor as the trainer's memory (kept by the caller until it is loaded); packed, copies of
    each tensor's bytes (the trainer reuses its buffer for the next chunk). ``opened`` keeps
    the packed buffer's mapping across the chunks of one transfer, keyed by its arguments: a
    handle opened once is released once (torch counts the opens on the trainer's side)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    tensors: list[torch.Tensor] = []
    for i, entry in enumerate(update.handles):
        args = entry.get(uuid)
        if args is None:
            raise ValueError(f"update_info.ipc_handles[{i}]: no handle for this engine's GPU "
                             f"{uuid}; the trainer sent {sorted(entry)}")
        key = tuple(tuple(a) if isinstance(a, list) else a
                    for j, a in enumerate(args) if j != 6)   # the sender's device index aside
        t = None if opened is None else opened.get(key)
        if t is None:
            t = bind_cuda_device(args, index, "update_info.ipc_handles").materialize(
                None, None)  # type: ignore[arg-type]
            if opened is not None:
                opened.clear()   # a new export: the previous buffer is released
                opened[key] = t
        tensors.append(t)
    if not update.packed:
        return list(zip(update.names, tensors))
    buffer = tensors[0]
    return [(n, buffer[at:at + size].clone().view(d).view(s))
            for n, d, s, at, size in zip(update.names, update.dtypes, update.shapes,
                                         update.offsets(), update.tensor_sizes or ())]
