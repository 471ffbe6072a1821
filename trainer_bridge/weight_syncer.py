"""`WeightSyncer`: push a trainer's weights to one or many engines over a chosen transport and
label them with a weight version.

    syncer = WeightSyncer([engine_a, engine_b], transport="distributed")   # joins the group
    report = syncer.sync(model, version="step-12")   # -> SyncReport(bytes, seconds, gbps, ...)
    syncer.close()                                    # destroys the group on every engine

Transports (see trainer_bridge.transports): "tensor" (colocated, handles), "distributed"
(broadcast: gloo on CPU, NCCL on GPU), "disk" (safetensors checkpoint), or any
`WeightTransport` instance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from trainer_bridge.bucketing import state_dict_items
from trainer_bridge.transports.base import WeightTransport, call_all, spawn
from trainer_bridge.transports.disk import DiskTransport
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncReport", "WeightSyncer", "make_transport"]

DEFAULT_BUCKET_BYTES = 512 << 20
TRANSPORTS = ("tensor", "distributed", "disk")


@dataclass(frozen=True)
class SyncReport:
    """One sync: `bytes` moved to each engine in `seconds` of wall time (packing included);
    `gbps` is gigabytes (1e9 bytes) per second; `version` is what the engines now report."""

    bytes: int
    seconds: float
    gbps: float
    version: str
    num_engines: int
    transport: str


def make_transport(transport: str, bucket_bytes: Optional[int], master_address: str,
                   master_port: Optional[int], backend: str) -> WeightTransport:
    """The transport named `transport`; `bucket_bytes=None` sends tensors one by one."""
    if transport == "tensor":
        return TensorTransport(bucket_bytes)
    if transport == "distributed":
        return DistributedTransport(master_address, master_port, backend, bucket_bytes)
    if transport == "disk":
        return DiskTransport()
    raise ValueError(f"transport: must be one of {TRANSPORTS} or a WeightTransport, "
                     f"got {transport!r}")


class WeightSyncer:
    """Owns a transport to a fixed list of engines (Engines or RolloutClients).

    bucket_bytes: buckets of at most this many bytes, one engine call each ("tensor" and
    "distributed"; CPU tensor buckets are groups of shared-memory handles, GPU ones flattened:
    see transports/tensor.py); None sends every tensor separately in a single call.
    master_address / master_port (None: a free port) / backend ("gloo" on CPU, "nccl" on GPU):
    the weight-update group of the "distributed" transport, formed in the constructor.
    """

    def __init__(self, engines: Union[Any, Sequence[Any]],
                 transport: Union[str, WeightTransport] = "tensor",
                 bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES,
                 master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 backend: str = "gloo") -> None:
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.engines:
            raise ValueError("engines: need at least one engine")
        self.transport = (transport if isinstance(transport, WeightTransport) else
                          make_transport(transport, bucket_bytes, master_address, master_port,
                                         backend))
        self.transport.setup(self.engines)
        self.closed = False
        self.last_report: Optional[SyncReport] = None

    def sync(self, model_or_named_tensors: Any, version: Optional[str] = None) -> SyncReport:
        """Load the weights of a module (its HF-named parameters; tied copies once), a state
        dict or (name, tensor) pairs into every engine, and set their weight version.

        version None: the syncer picks one past the engines' current version if that is an
        integer, else "1", and passes it explicitly (engines, like SGLang, leave their version
        unchanged by an update that names none). Don't modify the weights until this returns.
        """
        if self.closed:
            raise RuntimeError("this WeightSyncer is closed")
        if version is None:
            version = self._next_version()
        elif not isinstance(version, str) or not version:
            raise ValueError(f"version: must be a non-empty string or None, got {version!r}")
        start = time.perf_counter()
        moved = self.transport.push(self.engines, state_dict_items(model_or_named_tensors),
                                    version)
        seconds = time.perf_counter() - start
        self.last_report = SyncReport(
            bytes=moved, seconds=seconds, gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
            version=version, num_engines=len(self.engines), transport=self.transport.name)
        return self.last_report

    def _next_version(self) -> str:
        current = call_all([spawn(e.get_weight_version) for e in self.engines])
        numbers = [int(v) for v in current if isinstance(v, str) and v.isdigit()]
        return str(max(numbers) + 1) if numbers else "1"

    def close(self) -> None:
        """Release the transport (destroys the weight-update group on every engine)."""
        if not self.closed:
            self.closed = True
            self.transport.close(self.engines)

    def __enter__(self) -> WeightSyncer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
