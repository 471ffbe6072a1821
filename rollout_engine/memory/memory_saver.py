"""Sleep and wake by memory tag: release what the engine holds so a colocated trainer can use
it, while the process, tokenizer, process groups and server stay up.

Tags: ``weights`` (model parameters), ``kv_cache`` (the KV pool), ``cuda_graph`` (captured
graphs; nothing on CPU). The CPU saver frees tensor storage and asks the C allocator to give
the pages back to the OS (``malloc_trim``), so the process's RSS really drops.

Captured decode graphs hold the addresses of the weights and KV buffers, so releasing *any* tag
drops them (they are recaptured at the next decode); releasing ``cuda_graph`` also keeps them
off until it is resumed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Optional, Protocol

import torch
from torch import nn

from rollout_engine.memory import huge_pages
from rollout_engine.memory.kv_pool import KVPool
from rollout_engine.models import weight_writes

TAGS = ("weights", "kv_cache", "cuda_graph")


class GraphMemory(Protocol):
    """What the saver needs of the captured graphs (``model_runner.cuda_graph.DecodeGraphs``)."""

    def drop(self) -> int: ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...


class KVBuffers(Protocol):
    """KV memory besides the pool that ``kv_cache`` covers (``HostKVPool``)."""

    def nbytes(self) -> int: ...

    def release(self) -> None: ...

    def allocate(self) -> None: ...


class _NoGraphs:
    def drop(self) -> int:
        return 0

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


def _trim_heap() -> None:
    # Young generations only: the released storages are freed by refcount as soon as `p.data`
    # is replaced; a full collection walks every long-lived object (torch, transformers: ~0.6 s
    # per sleep on a busy 2-core machine) and finds nothing more to free.
    gc.collect(1)
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: freed pages go back when the allocator decides


class MemorySaver(ABC):
    """Releases and restores the engine's memory by tag.

    The caller (the scheduler, between batches) guarantees no forward pass runs and no request
    holds KV while ``kv_cache`` is released.
    """

    def __init__(self, model: nn.Module, kv_pool: KVPool, weights_cpu_backup: bool,
                 graphs: Optional[GraphMemory] = None,
                 extra_kv: Sequence[KVBuffers] = ()) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.extra_kv = list(extra_kv)   # released with kv_cache too (the HiCache host tier)
        self.graphs: GraphMemory = graphs if graphs is not None else _NoGraphs()
        self.weights_cpu_backup = weights_cpu_backup
        self.released: set[str] = set()
        self._shapes: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self._backup: Optional[dict[str, torch.Tensor]] = None

    def release(self, tags: list[str], weights_backup: Optional[bool] = None) -> int:
        """Free the memory of ``tags``; returns bytes released. Releasing twice is a no-op.
        ``weights_backup``: keep a CPU copy of the weights to restore on resume (None: the
        engine's ``enable_weights_cpu_backup``)."""
        freed = 0
        if set(tags) - self.released:
            freed += self.graphs.drop()   # before the buffers they point into go away
        for tag in tags:
            if tag in self.released:
                continue
            if tag == "cuda_graph":
                self.graphs.suspend()
            elif tag == "weights":
                freed += self._release_weights(
                    self.weights_cpu_backup if weights_backup is None else weights_backup)
            elif tag == "kv_cache":
                freed += self.kv_pool.nbytes()
                self.kv_pool.release()
                for buffers in self.extra_kv:
                    freed += buffers.nbytes()
                    buffers.release()
            self.released.add(tag)
        self._after_release()
        return freed

    def resume(self, tags: list[str]) -> bool:
        """Reallocate ``tags``. Returns True if the weights came back stale (no backup): the
        caller must refit or reload before serving."""
        stale = False
        for tag in tags:
            if tag not in self.released:
                continue
            if tag == "cuda_graph":
                self.graphs.resume()
            elif tag == "weights":
                stale = self._resume_weights()
            elif tag == "kv_cache":
                self.kv_pool.allocate()
                for buffers in self.extra_kv:
                    buffers.allocate()
            self.released.discard(tag)
        return stale

    def _release_weights(self, backup: bool) -> int:
        freed = 0
        params = dict(self.model.named_parameters())
        # the block's start drops the packed copies (before the backup is made: they go with
        # the weights they were made of)
        with weight_writes.writing():
            if backup:
                self._backup = {n: self._backup_copy(p.data) for n, p in params.items()}
            for name, p in params.items():
                self._shapes[name] = (p.shape, p.dtype, p.device)
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return freed

    def _resume_weights(self) -> bool:
        params = dict(self.model.named_parameters())
        backup, stale = self._backup, self._backup is None
        with weight_writes.writing(), torch.no_grad():
            for name, (shape, dtype, device) in self._shapes.items():
                params[name].data = huge_pages.zeros(shape, dtype, device)
            if backup is not None:
                for name, saved in backup.items():
                    params[name].data.copy_(saved)
        self._backup = None
        return stale

    @abstractmethod
    def _backup_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` that survives the release."""

    @abstractmethod
    def _after_release(self) -> None:
        """Return freed memory to the system."""


class CpuMemorySaver(MemorySaver):
    def _backup_copy(self, t: torch.Tensor) -> torch.Tensor:
        # On CPU a "backup" stays in RAM: it keeps the weights, so RSS does not drop for them.
        return t.clone()

    def _after_release(self) -> None:
        _trim_heap()


class CudaMemorySaver(MemorySaver):
    """Frees and reallocates device memory; captured CUDA graphs must then be recaptured
    (``torch_memory_saver``, when installed, keeps virtual addresses instead)."""

    def _backup_copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True).pin_memory()

    def _after_release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()


def create_memory_saver(model: nn.Module, kv_pool: KVPool, weights_cpu_backup: bool,
                        device: torch.device, graphs: Optional[GraphMemory] = None,
                        extra_kv: Sequence[KVBuffers] = ()) -> MemorySaver:
    cls = CudaMemorySaver if device.type == "cuda" else CpuMemorySaver
    return cls(model, kv_pool, weights_cpu_backup, graphs, extra_kv)
