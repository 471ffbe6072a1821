"""The flat CPU decode loop (`models/cpu_decode.py`) against the module path it replaces.

It runs the same kernels on the same tensors in the same order, so its hidden states must equal
``model(input_ids, positions, fb)`` bit for bit: at every batch size the products route
differently (the small-GEMM kernel at 32-64 rows, oneDNN elsewhere), with GRPO groups that
share their prompt's slots (cascade attention), lone rows, and after the weights were given new
storage (a refit's shadow swap) or written in place.
"""

from __future__ import annotations

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.memory.kv_pool import ReqToTokenPool
from rollout_engine.model_runner.attention.torch_native import (
    KERNEL_ENV,
    KernelDecodeMeta,
    TorchNativeBackend,
)
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.models.cpu_decode import FLAT_DECODE_ENV, CpuDecodeForward
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode
from rollout_engine.models.lora import MODULES, LoraBatch, LoraPool, LoraShapes, Stack

PROMPT, MAX_OWN = 24, 12
_rows_in_use: dict[int, list[int]] = {}     # id(runner) -> its table rows now held


def _runner(path: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                    max_total_tokens=8192, max_running_requests=160))


@pytest.fixture(scope="module")
def runners(tiny_paths) -> dict[str, ModelRunner]:
    return {arch: _runner(tiny_paths[arch]) for arch in ("qwen2", "llama")}


def _decode_batch(runner: ModelRunner, batch: int, group: int, gen: torch.Generator
                  ) -> ForwardBatch:
    """``batch`` rows in groups of ``group`` that share a PROMPT-slot prefix (group 1: every
    row alone), each with 1..MAX_OWN own slots; the pool holds random K/V everywhere."""
    pool, rtt = runner.kv_pool, runner.req_to_token
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.normal_(generator=gen)
    for row in _rows_in_use.pop(id(runner), []):   # the previous batch's rows
        rtt.free(row)
    perm = torch.randperm(pool.num_slots, generator=gen).tolist()
    take = iter(perm)
    rows, lens, loc, pos = [], [], [], []
    prompt: list[int] = []
    for b in range(batch):
        if b % group == 0:
            prompt = [next(take) for _ in range(PROMPT)]
        own = int(torch.randint(1, MAX_OWN + 1, (1,), generator=gen))
        slots = prompt + [next(take) for _ in range(own)]
        row = rtt.allocate()
        rtt.write(row, 0, slots)
        rows.append(row)
        _rows_in_use.setdefault(id(runner), []).append(row)
        lens.append(len(slots))
        loc.append(slots[-1])
        pos.append(len(slots) - 1)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    vocab = runner.arch.vocab_size
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.randint(0, vocab, (batch,), generator=gen),
        positions=t(pos), out_cache_loc=t(loc), req_pool_indices=t(rows), seq_lens=t(lens),
        prefix_lens=t(pos), extend_lens=t([1] * batch), logits_indices=t(list(range(batch))),
        seq_lens_list=lens, prefix_lens_list=pos, extend_lens_list=[1] * batch)


def _both(runner: ModelRunner, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(module path, flat loop) hidden states of one planned decode batch."""
    fb.attn_backend = runner.attn_backend
    runner.attn_backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_metadata, KernelDecodeMeta)
    with torch.inference_mode():
        ref = runner.model(fb.input_ids, fb.positions, fb)
        got = runner.flat_decode(runner.model, fb)
    return ref, got


def test_the_runner_takes_the_flat_loop_on_cpu_float32(runners):
    for runner in runners.values():
        assert isinstance(runner.flat_decode, CpuDecodeForward)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("batch,group", [(1, 1), (5, 1), (16, 8), (33, 8), (64, 8), (64, 1),
                                         (65, 5), (130, 8)])
def test_flat_decode_equals_the_module_path(runners, arch, batch, group):
    runner = runners[arch]
    fb = _decode_batch(runner, batch, group, torch.Generator().manual_seed(batch * 7 + group))
    ref, got = _both(runner, fb)
    assert got.shape == ref.shape == (batch, runner.arch.hidden_size)
    assert torch.equal(got, ref)
    if group > 1:   # every group of two or more rows shares its prompt (the cascade path)
        lone = 1 if batch % group == 1 else 0
        assert fb.attn_metadata.plan.num_grouped_rows == batch - lone


@pytest.mark.parametrize("stacked", [True, False])
def test_lora_adapters_in_the_flat_loop_equal_the_module_path(runners, monkeypatch, stacked):
    """A batch mixing adapters (and rows without one) takes the flat loop, which adds their
    updates where the modules do; stacked or slot by slot (``models/lora.py``)."""
    monkeypatch.setattr(Stack, "MAX_EXTRA", float("inf") if stacked else 0.0)
    runner = runners["qwen2"]
    gen = torch.Generator().manual_seed(21)
    shapes = LoraShapes.of(runner.arch)
    pool = LoraPool(shapes, 3, 8, frozenset(MODULES), torch.float32, torch.device("cpu"))
    for slot, rank in enumerate((8, 4, 2)):
        pool.write(slot, rank, 1.5, {
            (layer, m): (torch.randn(rank, shapes.features[m][0], generator=gen),
                         torch.randn(shapes.features[m][1], rank, generator=gen))
            for layer in range(shapes.num_layers) for m in MODULES})
    fb = _decode_batch(runner, 20, 4, gen)
    plain = _both(runner, fb)[0]
    fb.lora = LoraBatch(pool, [(s, torch.arange(s, 18, 3)) for s in range(3)])  # 18, 19: none
    ref, got = _both(runner, fb)
    assert torch.equal(got, ref)
    assert torch.equal(got[18:], plain[18:]) and not torch.equal(got[:18], plain[:18])
    assert (pool.stack((0, 1, 2), 0, "qkv_proj") is not None) == stacked
    assert torch.equal(runner.forward(fb), runner.model.compute_logits(got))


def test_the_runner_forward_gives_the_module_paths_logits(runners, monkeypatch):
    runner = runners["qwen2"]
    fb = _decode_batch(runner, 40, 8, torch.Generator().manual_seed(3))
    flat = runner.forward(fb)
    monkeypatch.setattr(runner, "flat_decode", None)
    assert torch.equal(runner.forward(fb), flat)


def test_a_backend_given_after_the_runner_was_built_is_the_one_used(tiny_paths):
    # as a speculative draft does: the runner's request table and backend are replaced
    runner = _runner(tiny_paths["qwen2"])
    runner.req_to_token = ReqToTokenPool(160 + 8, 512, runner.device)
    runner.attn_backend = TorchNativeBackend(runner.kv_pool, runner.req_to_token)
    fb = _decode_batch(runner, 40, 8, torch.Generator().manual_seed(9))
    flat = runner.forward(fb)
    runner.flat_decode = None
    assert torch.equal(runner.forward(fb), flat)


def test_new_weight_storage_and_in_place_writes_are_read(runners):
    runner = runners["llama"]
    gen = torch.Generator().manual_seed(11)
    fb = _decode_batch(runner, 48, 8, gen)
    before = _both(runner, fb)[1]
    layer = runner.model.layers[0]
    saved = {name: p.data for name, p in runner.model.named_parameters()}
    try:
        # a shadow swap: new storage; then an in-place write, as a refit copies bytes in
        layer.self_attn.qkv_proj.weight.data = layer.self_attn.qkv_proj.weight.data * 1.5
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(-1.0)
        ref, got = _both(runner, fb)
        assert torch.equal(got, ref)
        assert not torch.equal(got, before)
    finally:
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(-1.0)
        for name, p in runner.model.named_parameters():
            p.data = saved[name]


def test_it_is_off_where_a_piece_has_no_kernel(tiny_paths, monkeypatch):
    # qwen3's q/k norms: the module path
    assert _runner(tiny_paths["qwen3"]).flat_decode is None
    monkeypatch.setenv(FLAT_DECODE_ENV, "0")
    assert _runner(tiny_paths["qwen2"]).flat_decode is None
    monkeypatch.setenv(FLAT_DECODE_ENV, "1")
    monkeypatch.setenv(KERNEL_ENV, "0")     # no paged decode kernel: no flat loop
    assert _runner(tiny_paths["qwen2"]).flat_decode is None


def test_a_plan_that_disagrees_with_the_batch_is_refused(runners):
    runner = runners["qwen2"]
    fb = _decode_batch(runner, 8, 4, torch.Generator().manual_seed(5))
    runner.attn_backend.init_forward_metadata(fb)
    op, plan = runner.attn_backend.decode_kernel, fb.attn_metadata.plan
    a = runner.arch
    table = runner.req_to_token.table
    with pytest.raises(ValueError, match="disagree with the batch"):
        op.prepared(table, plan, 9, a.num_heads, a.num_kv_heads, a.head_dim)
    attend = op.prepared(table, plan, 8, a.num_heads, a.num_kv_heads, a.head_dim)
    k = runner.kv_pool.k_buffers[0]
    q = torch.zeros(8, a.num_heads * a.head_dim)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="contiguous float32"):
        attend(q.data_ptr(), q.stride(0), k[:, :1], k[:, :1], 1.0, out.data_ptr())
    with pytest.raises(ValueError, match="row stride"):
        attend(q.data_ptr(), 1, k, k, 1.0, out.data_ptr())
