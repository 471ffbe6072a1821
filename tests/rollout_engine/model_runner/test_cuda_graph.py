"""Decode CUDA graphs: padding, static inputs and recapture after sleep.

On CPU the capture is replaced by an eager run of the very function a graph records
(``run_static``), so everything but the CUDA capture itself is checked here: the padded rows,
the static-buffer loading, the padding slot and the memory saver's hooks. The ``gpu`` test
captures for real and compares with eager decode.
"""

from __future__ import annotations

import os

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.memory.memory_saver import create_memory_saver
from rollout_engine.model_runner.cuda_graph import (
    Captured,
    CudaGraphRunner,
    NoCudaGraphs,
    capture_batch_sizes,
)
from rollout_engine.model_runner.model_runner import ModelRunner
from tests.rollout_engine.model_runner.batches import decode_batch, make_reqs, prefill_batch

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1")
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 101, 102], [7, 300]]


class EagerGraphRunner(CudaGraphRunner):
    """CPU stand-in: each "graph" replays the recorded function eagerly into a fixed buffer."""

    def capture_all(self) -> None:
        self.drop()
        self._reset_buffers()
        vocab = self.model.arch.vocab_size
        for bs in self.batch_sizes:
            out = torch.empty(bs, vocab, device=self.device)

            def replay(bs: int = bs, out: torch.Tensor = out) -> None:
                out.copy_(self.run_static(bs))

            self.captured[bs] = Captured(replay=replay, logits=out)
        self.num_captures += 1


def _runner(path: str, device: str, dtype: str = "float32") -> ModelRunner:
    cfg = EngineConfig(model_path=path, device=device, dtype=dtype, attention_backend="triton",
                       max_total_tokens=512, max_running_requests=8)
    return ModelRunner(cfg)


def _decode_twice(runner: ModelRunner, graphs, reqs, steps: int = 2
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill, then decode steps (all requests, then all but the last): per step, the eager
    logits and the graph logits of the same batch."""
    dev = runner.device
    logits = runner.forward(prefill_batch(reqs, dev))
    next_ids = logits.argmax(-1).tolist()
    results = []
    for step_reqs in (reqs, reqs[:-1])[:steps]:
        fb = decode_batch(step_reqs, next_ids[:len(step_reqs)], dev)
        eager = runner.forward(fb)          # writes this step's K/V
        with torch.inference_mode():
            replayed = graphs.replay(fb)    # writes the same K/V again, plus the padding slot
        results.append((eager, replayed))
        next_ids = eager.argmax(-1).tolist()
    return results


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_cpu_runner_never_uses_graphs(qwen2_path):
    runner = ModelRunner(EngineConfig(model_path=qwen2_path, device="cpu", dtype="float32",
                                      max_total_tokens=64))
    assert isinstance(runner.graphs, NoCudaGraphs)
    assert runner.kv_pool.padding_slot == runner.max_total_num_tokens
    assert runner.kv_pool.k_buffers[0].shape[0] == runner.max_total_num_tokens + 1
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model_path=qwen2_path, cuda_graph_max_bs=0)


@needs_triton
@pytest.mark.slow   # every padded batch size replayed; on a GPU: benchmarks/gpu_check.py
def test_padded_static_decode_matches_eager(tiny_paths):
    runner = _runner(tiny_paths["qwen3"], "cpu")
    graphs = EagerGraphRunner(runner.model, runner.kv_pool, runner.req_to_token, max_bs=4)
    reqs = make_reqs(runner, PROMPTS, capacity=16)
    pool = runner.kv_pool
    for eager, replayed in _decode_twice(runner, graphs, reqs):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    # step 2 ran 3 requests in the size-4 graph: row 3 was pointed at the padding slot, not at
    # request 3's slot left over from step 1
    buf = graphs._buffers
    assert buf["out_cache_loc"][3].item() == pool.padding_slot
    assert buf["seq_lens"][3].item() == 1
    assert pool.k_buffers[0][pool.padding_slot].abs().sum() > 0
    # nothing but the requests' own slots and the padding slot was ever written
    used = {s for r in reqs for s in r.slots[:len(r.ids)]}
    untouched = [s for s in range(pool.num_slots) if s not in used]
    for layer in range(pool.num_layers):
        assert pool.k_buffers[layer][untouched].abs().sum() == 0
    assert graphs.num_captures == 1


@needs_triton
def test_memory_saver_drops_and_recaptures(tiny_paths):
    runner = _runner(tiny_paths["qwen2"], "cpu")
    graphs = EagerGraphRunner(runner.model, runner.kv_pool, runner.req_to_token, max_bs=2)
    saver = create_memory_saver(runner.model, runner.kv_pool, True, runner.device, graphs=graphs)
    reqs = make_reqs(runner, PROMPTS[:1], capacity=16)
    _decode_twice(runner, graphs, reqs, steps=1)
    assert graphs.captured and graphs.num_captures == 1

    saver.release(["kv_cache"])            # any release drops the graphs
    assert not graphs.captured and not graphs.can_run(decode_batch(reqs, [1], "cpu"))
    saver.resume(["kv_cache"])
    for r, prompt in zip(reqs, PROMPTS):
        r.ids = list(prompt)               # the KV is gone: recompute from the prompts
    for eager, replayed in _decode_twice(runner, graphs, reqs, steps=1):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert graphs.num_captures == 2        # recaptured lazily at the first decode

    saver.release(["cuda_graph"])          # graphs alone: off until resumed
    fb = decode_batch(reqs, [1], "cpu")
    assert graphs.suspended and not graphs.can_run(fb)
    saver.resume(["cuda_graph"])
    assert graphs.can_run(fb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(tiny_paths, dtype):
    runner = _runner(tiny_paths["qwen3"], "cuda", dtype)
    graphs = runner.graphs
    assert isinstance(graphs, CudaGraphRunner)
    reqs = make_reqs(runner, PROMPTS, capacity=16)
    # bf16: the padded graph runs GEMMs of another M than eager decode, so cuBLAS may pick
    # another kernel and round differently
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.02, atol=0.05)
    replayer = NoGraphsForward(runner)
    for eager, replayed in _decode_twice(runner, replayer, reqs):
        torch.testing.assert_close(replayed, eager, **tol)
    assert graphs.num_captures == 1 and graphs.captured


class NoGraphsForward:
    """Adapter for the GPU test: ``runner.forward`` uses graphs for decode, so the "eager"
    side must bypass them; this object replays through the runner's real graphs instead."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.graphs = runner.graphs
        runner.graphs = NoCudaGraphs()     # runner.forward is now the eager reference

    def replay(self, fb):
        return self.graphs.replay(fb)
