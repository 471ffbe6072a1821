"""CUDA graphs for decode: one captured forward per padded batch size, replayed with static inputs.

A decode step of B requests runs the graph of the smallest captured size ``bs >= B``. Its inputs
live in static buffers that the graph reads at fixed addresses; rows ``[B, bs)`` are padding:

    rows:            0 .......... B-1 | B ........ bs-1
    input_ids etc.   this step's      | stale (harmless)
    out_cache_loc    this step's      | kv_pool.padding_slot  (a write sink no request reads)
    seq_lens         this step's      | 1
    req_pool_indices this step's      | 0 (reads one slot of row 0; the output is dropped)

Attention inside the graph is always the Triton decode kernel: it reads ``seq_lens`` on the
device and sizes nothing from the host, so one capture serves every sequence length.

Graphs bake in the addresses of the weights and the KV buffers. Sleeping frees them, so the
memory saver calls ``drop()`` on any release; the next decode recaptures (lazily). Refits copy
into the same parameters and keep graphs valid. (``torch_memory_saver`` could keep virtual
addresses across sleep and skip the recapture; not used here.)
"""

from __future__ import annotations

import gc
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, ... up to ``max_bs`` (``max_bs`` itself included when not a power of two)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes, bs = [], 1
    while bs < max_bs:
        sizes.append(bs)
        bs *= 2
    return sizes + [max_bs]


class DecodeGraphs(ABC):
    """Decode forwards served from captured graphs. ``drop``/``suspend``/``resume`` are the
    memory saver's hooks; the caller holds the scheduler (no forward runs during them)."""

    @abstractmethod
    def can_run(self, fb: ForwardBatch) -> bool:
        """Whether ``replay(fb)`` may serve this batch."""

    @abstractmethod
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits ``[len(fb.logits_indices), vocab]`` float32; writes this step's K/V."""

    @abstractmethod
    def drop(self) -> int:
        """Free every graph (their addresses may be about to go stale); returns bytes freed
        as far as known. The next ``replay`` recaptures."""

    @abstractmethod
    def suspend(self) -> None:
        """Release of the ``cuda_graph`` tag: drop and stay off until ``resume``."""

    @abstractmethod
    def resume(self) -> None:
        """Allow capturing again (lazily, at the next eligible decode)."""


class NoCudaGraphs(DecodeGraphs):
    """CPU, ``disable_cuda_graph``, or the torch-native backend: every decode runs eagerly."""

    def can_run(self, fb: ForwardBatch) -> bool:
        return False

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("CUDA graphs are disabled")

    def drop(self) -> int:
        return 0

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


@dataclass
class Captured:
    replay: Callable[[], Any]
    logits: torch.Tensor   # [bs, vocab] float32, rewritten by every replay


class CudaGraphRunner(DecodeGraphs):
    """Captures ``model`` decode forwards for ``capture_batch_sizes(max_bs)``."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 max_bs: int) -> None:
        from rollout_engine.model_runner.attention.triton_backend import TritonBackend

        self.model = model
        self.kv_pool = kv_pool
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.device = kv_pool.device
        self.attn_backend = TritonBackend(kv_pool, req_to_token)
        self.captured: dict[int, Captured] = {}
        self.suspended = False
        self.num_captures = 0     # how many times the whole set was captured (tests, metrics)
        self.graph_bytes = 0
        self.pool: Optional[Any] = None
        self._buffers: dict[str, torch.Tensor] = {}

    # -- contract ------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode == ForwardMode.DECODE and not self.suspended
                and 0 < fb.batch_size <= self.max_bs and self.kv_pool.is_allocated)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        if not self.captured:
            self.capture_all()
        num = fb.batch_size
        bs = next(s for s in self.batch_sizes if s >= num)
        self._load(fb, bs)
        graph = self.captured[bs]
        graph.replay()
        return graph.logits[fb.logits_indices]   # a copy: the next replay rewrites the buffer

    def drop(self) -> int:
        freed = self.graph_bytes
        self.captured.clear()
        self.pool = None
        self.graph_bytes = 0
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def suspend(self) -> None:
        self.drop()
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    # -- static inputs ---------------------------------------------------------------------------
    def _reset_buffers(self) -> None:
        n, dev = self.max_bs, self.device

        def full(value: int) -> torch.Tensor:
            return torch.full((n,), value, dtype=torch.int64, device=dev)

        self._buffers = {
            "input_ids": full(0), "positions": full(0), "req_pool_indices": full(0),
            "out_cache_loc": full(self.kv_pool.padding_slot), "seq_lens": full(1),
            "prefix_lens": full(0), "extend_lens": full(1),
            "logits_indices": torch.arange(n, dtype=torch.int64, device=dev),
        }

    def _static_batch(self, bs: int) -> ForwardBatch:
        b = {k: v[:bs] for k, v in self._buffers.items()}
        ones = [1] * bs
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=b["input_ids"], positions=b["positions"],
            out_cache_loc=b["out_cache_loc"], req_pool_indices=b["req_pool_indices"],
            seq_lens=b["seq_lens"], prefix_lens=b["prefix_lens"], extend_lens=b["extend_lens"],
            logits_indices=b["logits_indices"], seq_lens_list=ones,
            prefix_lens_list=[0] * bs, extend_lens_list=ones)

    def _load(self, fb: ForwardBatch, bs: int) -> None:
        """Copy the step's inputs into rows ``[0, B)`` and point rows ``[B, bs)`` at padding."""
        buf, num = self._buffers, fb.batch_size
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
            buf[name][:num].copy_(getattr(fb, name))
        if bs > num:
            buf["out_cache_loc"][num:bs].fill_(self.kv_pool.padding_slot)
            buf["seq_lens"][num:bs].fill_(1)
            buf["req_pool_indices"][num:bs].zero_()

    # -- capture ---------------------------------------------------------------------------------
    def run_static(self, bs: int) -> torch.Tensor:
        """One eager decode forward over the static buffers' first ``bs`` rows (what a graph
        records); logits for every row."""
        fb = self._static_batch(bs)
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden)

    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool.
        Warm-up runs write only the padding slot, so live KV is safe mid-serving."""
        self.drop()
        self._reset_buffers()
        before = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        captured = {bs: self.capture(bs) for bs in reversed(self.batch_sizes)}
        torch.cuda.synchronize(self.device)
        self.captured = captured   # all or nothing: a failed capture leaves none to replay
        self.graph_bytes = max(0, torch.cuda.memory_reserved(self.device) - before)
        self.num_captures += 1
        logger.info("captured decode CUDA graphs for batch sizes %s (%.1f MiB)",
                    self.batch_sizes, self.graph_bytes / 2**20)

    def capture(self, bs: int) -> Captured:
        # Warm up on a side stream (compiles the Triton kernels and settles the allocator),
        # then record the same forward.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.run_static(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: in thread mode other threads of the process may touch CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=stream,
                              capture_error_mode="thread_local"):
            logits = self.run_static(bs)
        return Captured(replay=graph.replay, logits=logits)


def create_decode_graphs(model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                         *, device: torch.device, attention_backend: str, disabled: bool,
                         max_bs: int) -> DecodeGraphs:
    """Graphs on CUDA unless disabled; the torch-native backend keeps eager decode (it is the
    reference path and sizes its gather from the host)."""
    if device.type != "cuda" or disabled or attention_backend == "torch_native":
        return NoCudaGraphs()
    return CudaGraphRunner(model, kv_pool, req_to_token, max_bs)
