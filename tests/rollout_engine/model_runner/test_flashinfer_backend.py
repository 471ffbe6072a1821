"""FlashInfer backend: page-table construction (CPU), clear errors, the default backend choice,
and (``gpu``, with flashinfer installed) outputs against the torch-native reference. The calls
into flashinfer itself are only tested against the real library (a stand-in written from its
documentation would prove nothing about the library), so on CPU only the parts that are ours
run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import rollout_engine.config as config_module
from rollout_engine.config import EngineConfig
from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention import create_attention_backend
from rollout_engine.model_runner.attention.flashinfer_backend import kv_indices_from_table
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def test_kv_indices_from_table_concatenates_rows():
    table = torch.arange(5 * 12).reshape(5, 12) * 7
    rows, lens = [3, 0, 4], [5, 1, 12]
    got = kv_indices_from_table(table, torch.tensor(rows), torch.tensor(lens), lens)
    want = torch.cat([table[r, :n] for r, n in zip(rows, lens)]).to(torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    empty = kv_indices_from_table(table, torch.tensor([], dtype=torch.int64),
                                  torch.tensor([], dtype=torch.int64), [])
    assert empty.numel() == 0


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_missing_flashinfer_is_a_clear_error():
    pool = KVPool(16, 1, 2, 64, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="flashinfer-python"):
        create_attention_backend("flashinfer", pool, ReqToTokenPool(2, 16, torch.device("cpu")))


@pytest.mark.parametrize("device,dtype,importable,want", [
    ("cpu", "float32", True, "torch_native"),
    ("cuda", "bfloat16", True, "flashinfer"),
    ("cuda", "bfloat16", False, "triton"),
    ("cuda", "float32", True, "triton"),      # flashinfer has no float32 kernels
])
def test_default_attention_backend(qwen2_path, monkeypatch, device, dtype, importable, want):
    monkeypatch.setattr(config_module, "_importable", lambda name: importable)
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device(device))
    cfg = EngineConfig(model_path=qwen2_path, dtype=dtype)
    assert cfg.resolved_attention_backend() == want
    explicit = EngineConfig(model_path=qwen2_path, dtype=dtype, attention_backend="triton")
    assert explicit.resolved_attention_backend() == "triton"


def _batch(mode: ForwardMode, rows: list[int], prefix: list[int], ext: list[int],
           loc: torch.Tensor, device: str) -> ForwardBatch:
    seq = [p + e for p, e in zip(prefix, ext)]
    starts = [sum(ext[:i]) for i in range(len(ext))]

    def t(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    return ForwardBatch(mode=mode, input_ids=t([0] * sum(ext)), positions=t([0] * sum(ext)),
                        out_cache_loc=loc, req_pool_indices=t(rows), seq_lens=t(seq),
                        prefix_lens=t(prefix), extend_lens=t(ext),
                        logits_indices=t([s + e - 1 for s, e in zip(starts, ext)]),
                        seq_lens_list=seq, prefix_lens_list=prefix, extend_lens_list=ext)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLASHINFER),
                    reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(8, 2, 64), (16, 2, 128),
                                                                (4, 4, 128)])
def test_flashinfer_matches_torch_native(mode, num_q_heads, num_kv_heads, head_dim):
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    num_slots = 4096
    # extend: with and without a cached prefix, and one single-token extend
    prefix = [37, 1, 300, 5] if mode == ForwardMode.DECODE else [37, 0, 300, 5]
    ext = [1] * 4 if mode == ForwardMode.DECODE else [20, 64, 1, 7]

    def randn(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen.manual_seed(seed)).to(dev, dtype)

    outs = {}
    for name in ("torch_native", "flashinfer"):
        pool = KVPool(num_slots, 1, num_kv_heads, head_dim, dtype, torch.device(dev))
        table = ReqToTokenPool(6, 512, torch.device(dev))
        perm = torch.randperm(num_slots, generator=gen.manual_seed(1)).tolist()
        used = 0
        rows = [4, 1, 0, 3]
        for row, p, e in zip(rows, prefix, ext):
            table.write(row, 0, perm[used:used + p + e])
            used += p + e
        # the cached prefixes' K/V, as an earlier forward would have left them
        filled = torch.tensor(perm[:used], device=dev)
        pool.k_buffers[0][filled] = randn(2, used, num_kv_heads, head_dim)
        pool.v_buffers[0][filled] = randn(3, used, num_kv_heads, head_dim)
        loc = torch.cat([table.table[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
        n = sum(ext)
        q = randn(4, n, num_q_heads, head_dim)
        k, v = randn(5, n, num_kv_heads, head_dim), randn(6, n, num_kv_heads, head_dim)
        backend = create_attention_backend(name, pool, table)
        fb = _batch(mode, rows, prefix, ext, loc, dev)
        backend.init_forward_metadata(fb)
        outs[name] = backend.forward(q, k, v, 0, head_dim ** -0.5, fb).float()
    torch.testing.assert_close(outs["flashinfer"], outs["torch_native"], rtol=2e-2, atol=2e-2)
