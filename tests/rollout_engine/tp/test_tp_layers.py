"""The sharded pieces on their own, in one process (fast): two ranks as two threads over gloo
compute what the whole layers compute (a vocabulary that does not split evenly included), and
each rank loads exactly its slice of every checkpoint tensor, from disk (row slices read as
byte ranges, column slices copied from the mapping) and from tensors alike."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

from rollout_engine.models.llama import LlamaForCausalLM, ModelArch
from rollout_engine.models.tp_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from rollout_engine.parallel.context import TPContext
from rollout_engine.parallel.group import join_tp_group
from rollout_engine.weights.disk_reader import load_checkpoint
from rollout_engine.weights.loader import load_weights

ARCH = ModelArch(architecture="Qwen2ForCausalLM", hidden_size=16, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=4, intermediate_size=24, vocab_size=13,
                 rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                 max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True,
                 o_bias=False, mlp_bias=False, qk_norm=False)


def _on_two_ranks(fn: Callable[[TPContext], Any]) -> list[Any]:
    """``fn(ctx)`` on ranks 0 and 1 (threads), joined in one gloo group; their results."""
    store = dist.HashStore()
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        group = join_tp_group(store, r, 2, torch.device("cpu"), 30, 30)
        try:
            out[r] = fn(TPContext(r, 2, group))
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            out[r] = e
        finally:
            group.shutdown()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def test_sharded_layers_compute_what_the_whole_layers_do():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(13, 8, generator=gen)
    w_row, bias = torch.randn(6, 10, generator=gen), torch.randn(6, generator=gen)
    ids = torch.tensor([0, 6, 7, 12, 3, 12])
    x = torch.randn(len(ids), 10, generator=gen)

    def run(tp: TPContext) -> Any:
        emb = VocabParallelEmbedding(13, 8, tp)   # 7 rows a rank: rank 1's last is padding
        start, real, padded = tp.vocab(13)
        with torch.no_grad():
            emb.weight.zero_()
            emb.weight[:real] = table[start:start + real]
        row = RowParallelLinear(5, 6, True, tp)
        with torch.no_grad():
            row.weight.copy_(w_row[:, 5 * tp.rank:5 * tp.rank + 5])
            row.bias.copy_(bias)
        h = emb(ids)
        return h, row(x[:, 5 * tp.rank:5 * tp.rank + 5]), vocab_parallel_logits(
            h, emb.weight, tp, 13)

    (h0, y0, logits0), (h1, y1, logits1) = _on_two_ranks(run)
    assert torch.equal(h0, table[ids]) and torch.equal(h1, table[ids])   # x + 0 is exact
    torch.testing.assert_close(y0, F.linear(x, w_row, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(y0, y1)
    assert logits1 is None and logits0.shape == (len(ids), 13)
    torch.testing.assert_close(logits0, table[ids] @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_slice_from_disk_and_from_tensors(tmp_path, rank):
    gen = torch.Generator().manual_seed(1)
    with torch.device("meta"):
        whole = LlamaForCausalLM(ARCH)
    full = {name: torch.randn((rows, *p.shape[1:]) if p.dim() else (), generator=gen)
            for name, (p, _, rows) in whole.weight_map().items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    tp = TPContext(rank, 2, group=None)
    models = []
    for load in (lambda m: load_checkpoint(m, str(tmp_path)),
                 lambda m: load_weights(m, list(full.items()), require_all=True)):
        with torch.device("meta"):
            model = LlamaForCausalLM(ARCH, tp=tp)
        model = model.to_empty(device="cpu")
        load(model)
        models.append(model)
    shards = models[0].tp_shards()
    assert shards["model.layers.0.self_attn.o_proj.weight"].dim == 1      # columns
    assert shards["lm_head.weight"].length == (7 if rank == 0 else 6)   # 13 = 7 + 6
    for model in models:
        for name, (param, row0, rows) in model.weight_map().items():
            got = param.data.narrow(0, row0, rows) if param.dim() else param.data
            shard = shards.get(name)
            want = full[name] if shard is None else shard.of(full[name])
            assert torch.equal(got, want), name
