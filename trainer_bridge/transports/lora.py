"""Adapter transports: how one LoRA adapter's tensors reach the engines (``LoraSyncer``).

    "tensor"  one ``load_lora_adapter_from_tensors(upsert=True)`` call per engine: the
              adapter's tensors as handles (shared memory on CPU, moved there in place as the
              full-weight tensor transport does; CUDA IPC on GPU); packed into one flattened
              bucket (``load_format="flattened_bucket"``, a buffer reused from sync to sync)
              when a tensor is on a GPU or with ``pack=True``
    "disk"    the adapter directory written to a temp dir (PEFT's ``save_pretrained`` for a
              PeftModel), then ``load_lora_adapter(upsert=True)`` per engine, then deleted

An adapter is always one call: the engine checks the whole adapter before it switches to it
(a refused one changes nothing there), so it cannot be split into buckets. There is no
broadcast transport: the engine has no route that receives an adapter over a process group.
"""

from __future__ import annotations

import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any, Optional

from rollout_engine.protocol.bucket import plan_buckets
from trainer_bridge.client import RolloutError
from trainer_bridge.lora_source import AdapterSource
from trainer_bridge.transports.base import WeightSyncError, call_all, spawn
from trainer_bridge.transports.tensor import BucketBuffers

__all__ = ["LORA_TRANSPORTS", "LoraDiskTransport", "LoraTensorTransport", "LoraTransport",
           "make_lora_transport"]

LORA_TRANSPORTS = ("tensor", "disk")


class LoraTransport(ABC):
    """Moves one adapter into engines under a name, replacing what that name held."""

    name: str = "abstract"

    @abstractmethod
    def push(self, engines: Sequence[Any], lora_name: str, source: AdapterSource
             ) -> tuple[int, list[dict[str, Any]]]:
        """Load ``source`` as ``lora_name`` into every engine (a new name is loaded, a loaded
        one upserted: requests already bound to it finish on the old weights). Returns the
        bytes moved to each engine (counted once however many engines) and each engine's
        answer (``{"success", "loaded_adapters"}``), in the order of ``engines``.

        Each engine checks the whole adapter before it switches; a refusal raises
        ``WeightSyncError`` with its message, and engines that accepted keep the new version.
        The caller must not modify the tensors until this returns."""

    def close(self) -> None:
        """Release what the transport keeps between pushes (buffers). Default: nothing."""
        return None


def make_lora_transport(transport: str, pack: Optional[bool] = None,
                        directory: Optional[str] = None, timeout_s: Optional[float] = None
                        ) -> LoraTransport:
    """The adapter transport named ``transport`` ("tensor" or "disk")."""
    if transport == "tensor":
        return LoraTensorTransport(pack, timeout_s)
    if transport == "disk":
        return LoraDiskTransport(directory, timeout_s)
    if transport == "distributed":
        raise ValueError("transport: 'distributed' is not available for adapters: the engine "
                         "has no route that receives an adapter by broadcast; use 'tensor' "
                         "(same host) or 'disk' (a shared filesystem)")
    raise ValueError(f"transport: must be one of {LORA_TRANSPORTS} or a LoraTransport, "
                     f"got {transport!r}")


def _load(engine: Any, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``engine.<method>(...)``; a refusal (ValueError from an Engine, an HTTP 4xx from a
    client) raises WeightSyncError naming the engine and the reason."""
    try:
        return getattr(engine, method)(*args, **kwargs)
    except RolloutError as e:
        if e.status >= 500:
            raise
        raise WeightSyncError(f"{method} refused by {type(engine).__name__}: {e.message}"
                              ) from e
    except ValueError as e:
        raise WeightSyncError(f"{method} refused by {type(engine).__name__}: {e}") from e


def _every_answer(calls: Sequence[Future[Any]], timeout_s: Optional[float]) -> list[Any]:
    """Every call's answer; on a failure the others are waited for first (none of them still
    reads the trainer's tensors or files when this raises), then the first failure raised.
    TimeoutError when some call is still running after ``timeout_s``."""
    _, running = wait(calls, timeout=timeout_s)
    if running:
        raise TimeoutError(f"{len(running)} engine call(s) did not finish within {timeout_s}s")
    return call_all(calls)


class LoraTensorTransport(LoraTransport):
    """Handles through ``load_lora_adapter_from_tensors``; every engine at once (a thread
    each). pack: one flattened bucket (True), the tensors' own handles (False), or (None)
    packed only when a tensor is on a GPU."""

    name = "tensor"

    def __init__(self, pack: Optional[bool] = None, timeout_s: Optional[float] = None) -> None:
        if pack not in (None, True, False):
            raise ValueError(f"pack: must be None, True or False, got {pack!r}")
        self.pack = pack
        self.timeout_s = timeout_s
        self.buffers = BucketBuffers()

    def push(self, engines: Sequence[Any], lora_name: str, source: AdapterSource
             ) -> tuple[int, list[dict[str, Any]]]:
        tensors = source.tensors
        packs = self.pack if self.pack is not None else any(t.is_cuda for _, t in tensors)
        if not packs:
            payload: Any = tensors
            load_format = None
            moved = source.nbytes()
        else:
            plans = list(plan_buckets(tensors, 1 << 62))
            if len(plans) != 1:
                raise ValueError("tensors: an adapter's tensors must all be on one device "
                                 "to be packed")
            plan = plans[0]
            payload = plan.fill(self.buffers.slot(0, plan.num_bytes, plan.device))
            load_format, moved = "flattened_bucket", plan.num_bytes
        calls = [spawn(_load, e, "load_lora_adapter_from_tensors", lora_name, payload,
                       source.config, load_format=load_format, upsert=True) for e in engines]
        try:
            return moved, _every_answer(calls, self.timeout_s)
        except TimeoutError:
            self.buffers.release()   # an engine may still read the buffer: never refill it
            raise

    def close(self) -> None:
        self.buffers.release()


class LoraDiskTransport(LoraTransport):
    """Each push writes ``<directory>/lora-*/`` (the system temp directory when None), loads
    it on every engine (a thread each) and deletes it. A remote server must see the path."""

    name = "disk"

    def __init__(self, directory: Optional[str] = None, timeout_s: Optional[float] = None
                 ) -> None:
        self.directory = directory
        self.timeout_s = timeout_s

    def push(self, engines: Sequence[Any], lora_name: str, source: AdapterSource
             ) -> tuple[int, list[dict[str, Any]]]:
        path = tempfile.mkdtemp(prefix="lora-", dir=self.directory)
        try:
            adapter_dir = source.save(path)
            answers = _every_answer([spawn(_load, e, "load_lora_adapter", lora_name,
                                           adapter_dir, upsert=True) for e in engines],
                                    self.timeout_s)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return source.nbytes(), answers
