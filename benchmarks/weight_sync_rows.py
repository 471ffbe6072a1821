"""The rows `bench_weight_sync.py` times: each a way to refit an engine (a transport and bucket
size, a trainer dtype), and the recorder of the engine's own apply time.

    configs(quick)  (transport, bucket bytes, trainer dtype) of every row
    Row.sync        one refit through the row's path, timed (and its engine apply time)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.weight_sync_limits import CAST
from rollout_engine import Engine
from rollout_engine.weights.loader import safetensors_files
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport
from trainer_bridge.weight_syncer import WeightSyncer

MB = 1 << 20


class ApplyRecorder:
    """Wraps the engine's ``tm.start_call`` (every control call, sent at once or through
    ``send_call``) to collect the scheduler-side ``seconds`` of each weight update and how many
    tensors it cast."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.orig, self.seconds, self.num_cast = engine, engine.tm.start_call, 0.0, 0

        def start_call(method: str, timeout: Any = None, **kw: Any) -> Any:
            wait = self.orig(method, timeout, **kw)

            def answer() -> Any:
                r = wait()
                if (method.startswith("update_weights") and r.success
                        and isinstance(r.result, dict)):
                    self.seconds += float(r.result.get("seconds", 0.0))
                    self.num_cast += int(r.result.get("num_cast", 0))
                return r

            return answer

        engine.tm.start_call = start_call  # type: ignore[method-assign]

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def configs(quick: bool) -> list[tuple[str, Optional[int], torch.dtype]]:
    """(transport, bucket bytes, trainer dtype) of every row; transport "disk" is the engine's
    load of the model directory, "disk-syncer" the disk transport (write, then load)."""
    buckets = [16 * MB, 256 * MB] if quick else [16 * MB, 64 * MB, 256 * MB, 1024 * MB]
    fp32 = torch.float32
    return ([("tensor", None, fp32), ("tensor", None, CAST)]
            + [("tensor", b, fp32) for b in buckets]
            + [("tensor-packed", b, fp32) for b in buckets[::len(buckets) - 1]]
            + [("distributed", None, fp32)]
            + [("distributed", b, fp32) for b in buckets]
            + [("distributed-packed", b, fp32) for b in buckets[::len(buckets) - 1]]
            + [("disk", None, fp32), ("disk-syncer", None, fp32)])


def label(transport: str, bucket: Optional[int], dtype: torch.dtype = torch.float32) -> str:
    if transport == "disk":
        return "disk (load the model dir)"
    if transport == "disk-syncer":
        return "disk (syncer: write + load)"
    lab = f"{transport}/{'none' if bucket is None else f'{bucket // MB}MB'}"
    return lab if dtype == torch.float32 else f"{lab}, bf16 -> fp32 cast"


class Row:
    """One row: a way to refit `eng`, timed once per `sync` call."""

    def __init__(self, eng: Engine, rec: ApplyRecorder, transport: str, bucket: Optional[int],
                 dtype: torch.dtype, source: Any, model_path: str, index: int) -> None:
        self.eng, self.rec, self.source, self.model_path = eng, rec, source, model_path
        self.transport, self.bucket, self.dtype = transport, bucket, dtype
        self.label = label(transport, bucket, dtype)
        self.syncer: Optional[WeightSyncer] = None
        if transport.startswith("distributed"):   # rows of a round are open together: own groups
            self.syncer = WeightSyncer(eng, DistributedTransport(
                bucket_bytes=bucket, backend="gloo", group_name=f"bench-{index}",
                pack=transport == "distributed-packed"))
        elif transport == "tensor-packed":   # CPU buckets as flat copies (the CUDA layout)
            self.syncer = WeightSyncer(eng, TensorTransport(bucket, pack=True))
        elif transport in ("tensor", "disk-syncer"):
            self.syncer = WeightSyncer(eng, transport=transport.removesuffix("-syncer"),
                                       bucket_bytes=bucket)
        self.seconds: list[float] = []
        self.round_limits: list[dict[str, float]] = []   # the rooflines timed in each round
        self.applies: list[float] = []
        self.bytes = 0
        self.num_cast = 0

    def sync(self, version: str, record: bool = True) -> None:
        self.rec.take()
        if self.syncer is None:   # the engine reads the model directory itself
            t0 = time.perf_counter()
            ok, message = self.eng.update_weights_from_disk(self.model_path,
                                                            weight_version=version)
            seconds, moved = time.perf_counter() - t0, total_bytes(self.model_path)
            assert ok, message
        else:
            rep = self.syncer.sync(self.source, version=version)
            seconds, moved = rep.seconds, rep.bytes
        assert self.eng.get_weight_version() == version
        apply, num_cast = self.rec.take(), self.rec.num_cast
        self.rec.num_cast = 0
        if record:
            self.seconds.append(seconds)
            self.applies.append(apply)
            self.bytes = moved
            self.num_cast += num_cast

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()


def total_bytes(path: str) -> int:
    return sum(Path(f).stat().st_size for f in safetensors_files(path))
