"""The three vLLM names TRL 1.16's ``VLLMClient`` imports, for a CPU machine without vLLM.

``trl/generation/vllm_client.py`` refuses to construct without an importable ``vllm`` package,
and takes from it only (``vllm.LLM``, ``SamplingParams``, ``RequestOutput`` and
``vllm.sampling_params.StructuredOutputsParams`` are imported too, for colocate mode only: here
they are placeholders that refuse to be built):

    vllm.utils.network_utils.get_ip                                  (master_address)
    vllm.distributed.weight_transfer.nccl_common.trainer_init        (rank 0 of the group)
    vllm.distributed.weight_transfer.packed_tensor.packed_nccl_broadcast_producer

vLLM's own ``trainer_init`` builds a ``PyNcclCommunicator`` (CUDA + libnccl) and its producer
packs on ``torch.cuda.Stream``s, so neither runs on CPU. These stand-ins keep the wire sequence
(the trainer hosts the TCPStore as rank 0; the tensors' bytes, concatenated in order, go out as
uint8 chunks, a chunk closed as soon as its size passes ``buffer_size_bytes``) and run it over a
gloo group joined with the engine's own ``join_update_group``. `install` writes a ``vllm``
package of re-exports into a virtual environment's site-packages.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rollout_engine.protocol.weight_broadcast import UpdateGroup, join_update_group

STANDIN_VERSION = "0.31.0"   # the newest vLLM TRL 1.16 names as supported
GROUP_NAME = "vllm_weight_transfer"   # the group the engine joins for vLLM's native transfer
BUFFER_SIZE_BYTES = 1024 * 1024 * 1024   # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
JOIN_TIMEOUT_S = 60.0


def get_ip() -> str:
    """``VLLM_HOST_IP`` if set, else loopback (the test's server runs on this machine)."""
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")


class _Rendezvous:
    """What ``VLLMClient.close_communicator`` clears (``group.store``, ``group.socket``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.socket: Any = None


class TrainerEndpoint:
    """Rank 0 of the trainer <-> server group: ``broadcast(tensor, src)`` blocks until sent."""

    def __init__(self, group: UpdateGroup) -> None:
        self.update_group = group
        self.group = _Rendezvous(group.store)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.update_group.broadcast(tensor, src=src).wait()


def trainer_init(init_info: Any, rank: int = 0) -> TrainerEndpoint:
    """Join as ``rank`` (0: host the store) the group at ``master_address:master_port``."""
    info = init_info if isinstance(init_info, dict) else vars(init_info)
    group = join_update_group(info["master_address"], int(info["master_port"]), rank,
                              int(info["world_size"]), GROUP_NAME, "gloo", JOIN_TIMEOUT_S)
    return TrainerEndpoint(group)


def packed_nccl_broadcast_producer(
        iterator: Iterator[tuple[str, torch.Tensor]], group: TrainerEndpoint, src: int,
        post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
        buffer_size_bytes: int = BUFFER_SIZE_BYTES, num_buffers: int = 2) -> None:
    """Broadcast the iterator's tensors as uint8 chunks: bytes appended in order until the
    chunk's size passes ``buffer_size_bytes``, then the chunk goes out; the rest as a last one."""
    del num_buffers   # double buffering only overlaps CUDA streams
    pieces: list[torch.Tensor] = []
    size = 0
    for item in iterator:
        flat = post_iter_func(item).detach().contiguous().view(-1).view(torch.uint8)
        pieces.append(flat)
        size += flat.numel()
        if size > buffer_size_bytes:
            group.broadcast(torch.cat(pieces), src=src)
            pieces, size = [], 0
    if pieces:
        group.broadcast(torch.cat(pieces), src=src)


class ColocateOnly:
    """vLLM's in-process classes, which only TRL's colocate mode builds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the vLLM stand-in serves TRL's server mode only")


_REEXPORTS = {
    "vllm/__init__.py": "ColocateOnly as LLM, ColocateOnly as RequestOutput, "
                        "ColocateOnly as SamplingParams",
    "vllm/sampling_params.py": "ColocateOnly as StructuredOutputsParams",
    "vllm/utils/network_utils.py": "get_ip",
    "vllm/distributed/weight_transfer/nccl_common.py": "trainer_init",
    "vllm/distributed/weight_transfer/packed_tensor.py": "packed_nccl_broadcast_producer",
}


def install(site_packages: Path) -> None:
    """Write the ``vllm`` stand-in (re-exports of this module) and its distribution metadata
    into ``site_packages``; the interpreter that imports it needs the repository on its path."""
    for package in ("vllm", "vllm/utils", "vllm/distributed", "vllm/distributed/weight_transfer"):
        (site_packages / package).mkdir(parents=True, exist_ok=True)
        (site_packages / package / "__init__.py").write_text("")
    for path, names in _REEXPORTS.items():
        (site_packages / path).write_text(f"from {__name__} import {names}  # noqa: F401\n")
    with (site_packages / "vllm/__init__.py").open("a") as init:
        init.write(f'__version__ = "{STANDIN_VERSION}"\n')
    dist = site_packages / f"vllm-{STANDIN_VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(textwrap.dedent(f"""\
        Metadata-Version: 2.1
        Name: vllm
        Version: {STANDIN_VERSION}
        """))
    (dist / "top_level.txt").write_text("vllm\n")
    (dist / "INSTALLER").write_text("rollout-engine-tests\n")
    (dist / "RECORD").write_text("")


def site_packages_of(python: Path) -> Path:
    """The site-packages folder of the virtual environment whose interpreter is ``python``."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return python.parent.parent / "lib" / version / "site-packages"
