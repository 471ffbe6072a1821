"""Weight broadcasts as SGLang and the trainers written for it do them: the group and the bucket.

Group. SGLang's engine (``ModelRunner.init_weights_update_group`` ->
``utils.init_custom_process_group``) and its trainers (slime's ``init_process_group``, OpenRLHF's
copy) all run, with the trainer at rank 0 and engine ranks ``rank_offset + tp_rank``:

    store = rendezvous(f"tcp://{addr}:{port}", rank, world_size)   # rank 0 hosts a TCPStore
    pg = torch's _new_process_group_helper(world_size, rank, [], backend,
                                           PrefixStore(group_name, store), group_name=group_name)

The helper nests two more prefixes and builds one backend per distinct backend of the device
map (gloo serves "cpu" and "cuda" with one backend, made for "cpu"; nccl serves "cuda"):

    keys:  <group_name>/<group_name>//cpu//<gloo's rendezvous keys>

`join_update_group` builds that backend on those same keys, in the same order, but does not
register it in torch's process-wide group registry (``torch.distributed._world``): the caller's
own distributed state stays untouched, and a trainer and a thread-mode engine can join one group
from one process. ``tests/rollout_engine/compat/test_slime_distributed.py`` checks it against
torch's helper itself. (Not mirrored: the extra wrapper group of TORCH_DISTRIBUTED_DEBUG=DETAIL.)

Bucket (``load_format="flattened_bucket"``). SGLang's ``FlattenedTensorBucket`` concatenates the
tensors' bytes back to back, in order, with no padding; the broadcast is that one uint8 buffer:

    | a: 3 x bf16 (6 B) | b: 2 x fp32 (8 B) | ...      b starts at byte 6: not 4-aligned,
    0                   6                   14         so its view is copied (`unflatten`,
                                                       once every byte has been received)
"""

from __future__ import annotations

import datetime
import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from rollout_engine.env_knobs import env_int

__all__ = [
    "GroupIncompleteError",
    "StoreUnreachableError",
    "UpdateGroup",
    "flatten",
    "flat_layout",
    "join_update_group",
    "tcp_init_method",
    "unflatten",
]


class StoreUnreachableError(TimeoutError):
    """Rank > 0: rank 0's TCPStore did not answer within the timeout (rank 0 is missing)."""


class GroupIncompleteError(TimeoutError):
    """The store was reached but not every rank built its side in time; ``missing`` lists the
    ranks that never arrived (empty when torch's key layout did not allow telling)."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def tcp_init_method(address: str, port: int) -> str:
    """``tcp://host:port``, an IPv6 literal in brackets (SGLang's NetworkAddress.to_tcp)."""
    try:
        if isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address):
            return f"tcp://[{address}]:{port}"
    except ValueError:
        pass  # a host name
    return f"tcp://{address}:{port}"


@dataclass(eq=False)
class UpdateGroup:
    """One rank's side of a weight-update group: the c10d backend per device type."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    backends: dict[str, Any]
    store: Any = field(repr=False)   # keeps the TCPStore (rank 0: its server) alive

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast of ``tensor`` from rank ``src``; returns the Work to ``wait()``."""
        backend = self.backends.get(tensor.device.type)
        if backend is None:
            raise ValueError(f"group {self.group_name!r} ({self.backend}) cannot broadcast "
                             f"{tensor.device.type} tensors")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return backend.broadcast([tensor], opts)

    def shutdown(self) -> None:
        for backend in {id(b): b for b in self.backends.values()}.values():
            stop = getattr(backend, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except RuntimeError:
                    pass  # already torn down by a peer's failure
        self.backends = {}


def _device_backends(backend: str) -> list[tuple[list[str], str]]:
    """(device types, backend name) in the order torch's helper builds them: one backend for all
    devices when the device map names a single backend."""
    device_map = BackendConfig(Backend(backend)).get_device_backend_map()
    if len(set(device_map.values())) == 1:
        return [(list(device_map), next(iter(device_map.values())))]
    return [([device], name) for device, name in device_map.items()]


GLOO_THREADS = 8
"""Worker threads of a gloo weight-update group (torch's default is 2): an unbucketed update is
one broadcast per tensor, and more workers keep more of them in flight (on the 2-core machine
99 per-tensor broadcasts of the 55M model took 0.058-0.065 s with 8 threads, 0.068-0.074 s
with 2; one flat broadcast of the same bytes 0.05-0.065 s)."""


def gloo_threads() -> int:
    """``ROLLOUT_ENGINE_GLOO_THREADS`` if set, else `GLOO_THREADS`."""
    return env_int("ROLLOUT_ENGINE_GLOO_THREADS", GLOO_THREADS, 1, 64)


def _make_backend(name: str, store: Any, rank: int, world_size: int, group_name: str,
                  timeout: datetime.timedelta) -> Any:
    made: Any
    options: Any
    if name == Backend.GLOO:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._threads = gloo_threads()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        made = dist.ProcessGroupGloo(store, rank, world_size, opts)
        options = made.options
        options.global_ranks_in_group = []
        options.group_name = group_name
    elif name == Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = []
        options.group_name = group_name
        made = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"backend: must be 'gloo' or 'nccl', got {name!r}")
    made._set_sequence_number_for_group()
    return made


def _open_store(address: str, port: int, rank: int, world_size: int,
                timeout: datetime.timedelta) -> Any:
    if rank == 0:
        # rendezvous() would wait here for every rank to connect; waiting in the backend's
        # rendezvous instead lets a timeout say which ranks never came (peers see no difference)
        return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, multi_tenant=True)
    try:
        store, _, _ = next(dist.rendezvous(tcp_init_method(address, port), rank, world_size,
                                           timeout=timeout))
    except (RuntimeError, TimeoutError) as e:   # DistStoreError is a RuntimeError
        raise StoreUnreachableError(
            f"rank 0 did not open its TCPStore at {address}:{port} within "
            f"{timeout.total_seconds():g} s ({str(e).splitlines()[0]})") from None
    store.set_timeout(timeout)
    return store


def join_update_group(address: str, port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float) -> UpdateGroup:
    """Take rank ``rank`` of group ``group_name`` exactly as SGLang's init_custom_process_group
    does; blocks until every rank has joined. Raises StoreUnreachableError (rank > 0 only) or
    GroupIncompleteError after ``timeout_s`` seconds."""
    if not group_name:
        raise ValueError("group_name: must be a non-empty string")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(group_name, _open_store(address, port, rank, world_size, timeout))
    helper_store = dist.PrefixStore(f"{group_name}/", store)   # _new_process_group_helper's
    backends: dict[str, Any] = {}
    for devices, name in _device_backends(backend):
        prefixed = dist.PrefixStore(f"{devices[0]}/", helper_store)
        try:
            made = _make_backend(name, prefixed, rank, world_size, group_name, timeout)
        except RuntimeError as e:
            missing = _missing_ranks(prefixed, world_size)
            raise GroupIncompleteError(
                f"the {world_size} ranks of group {group_name!r} did not all join within "
                f"{timeout_s:g} s ({str(e).splitlines()[0]})", missing) from None
        backends.update(dict.fromkeys(devices, made))
    return UpdateGroup(group_name, rank, world_size, backend, backends, store)


def _missing_ranks(prefixed: Any, world_size: int) -> list[int]:
    """Ranks whose gloo rendezvous key (``<seq>/<rank>``) never appeared; [] when none of them
    is found (another torch key layout, or nccl's lazy rendezvous): the caller says less."""
    try:
        joined = [r for r in range(world_size) if prefixed.check([f"0/{r}"])]
    except RuntimeError:
        return []
    return [r for r in range(world_size) if r not in joined] if joined else []


# -- the flattened_bucket broadcast --------------------------------------------------------------
def flat_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
                ) -> tuple[list[tuple[int, int]], int]:
    """Byte ranges ``[start, end)`` of tensors packed back to back (SGLang's bucket), and the
    buffer's total size."""
    if len(dtypes) != len(shapes):
        raise ValueError("dtypes and shapes must have the same length")
    ranges, used = [], 0
    for dtype, shape in zip(dtypes, shapes):
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        ranges.append((used, used + nbytes))
        used += nbytes
    return ranges, used


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding ``tensors``' bytes back to back (FlattenedTensorBucket's)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten(buffer: torch.Tensor, dtypes: Sequence[torch.dtype],
              shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The tensors of a back-to-back buffer: views, or copies where a tensor starts at a byte
    its dtype cannot be viewed at. A copy holds the bytes of the moment it is taken: call this
    on a received buffer only once its receive has completed."""
    ranges, total = flat_layout(dtypes, shapes)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != total:
        raise ValueError(f"flattened bucket: expected {total} uint8 bytes, got "
                         f"{buffer.numel()} {buffer.dtype}")
    out = []
    for (start, end), dtype, shape in zip(ranges, dtypes, shapes):
        piece = buffer[start:end]
        if piece.data_ptr() % dtype.itemsize or not piece.numel():
            piece = piece.clone()
        out.append(piece.view(dtype).view(tuple(int(d) for d in shape)))
    return out
