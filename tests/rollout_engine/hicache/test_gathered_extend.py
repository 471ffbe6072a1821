"""The EXTEND attention HiCache hits take: requests adding several tokens to a long cached
prefix (what a multi-turn history loaded back from L2 is), batched into padded SDPA groups by
``TorchNativeBackend``. Checked against float64 attention over each request's slots, and
against the per-request SDPA it replaced (same float32 math, one request at a time)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention import torch_native
from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

TOL_REF = 1e-5     # vs float64
TOL_LOOP = 1e-6    # vs float32 SDPA request by request


def _batch(gen: torch.Generator, reqs: list[tuple[int, int]], hq: int, hkv: int, d: int):
    """reqs: (prefix_len, extend_len) each; slots scattered over the pool, stale table
    entries past every row (what a reused req_to_token row holds)."""
    max_len = max(p + e for p, e in reqs)
    num_slots = sum(p + e for p, e in reqs) + 16
    pool = KVPool(num_slots, 1, hkv, d, torch.float32, torch.device("cpu"))
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rtt = ReqToTokenPool(len(reqs) + 2, max_len + 8, torch.device("cpu"))
    rtt.table.random_(0, num_slots, generator=gen)
    free = iter(torch.randperm(num_slots, generator=gen).tolist())
    rows, out_loc = [], []
    for prefix, ext in reqs:
        slots = [next(free) for _ in range(prefix + ext)]
        row = rtt.allocate()
        rtt.write(row, 0, slots)
        rows.append(row)
        out_loc += slots[prefix:]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    prefix_lens = [p for p, _ in reqs]
    ext_lens = [e for _, e in reqs]
    seq_lens = [p + e for p, e in reqs]
    n = sum(ext_lens)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=t([0] * n),
        positions=t([p for pl, e in reqs for p in range(pl, pl + e)]),
        out_cache_loc=t(out_loc), req_pool_indices=t(rows), seq_lens=t(seq_lens),
        prefix_lens=t(prefix_lens), extend_lens=t(ext_lens), logits_indices=t([n - 1]),
        seq_lens_list=seq_lens, prefix_lens_list=prefix_lens, extend_lens_list=ext_lens)
    return pool, rtt, fb, (torch.randn(n, hq, d, generator=gen),
                           torch.randn(n, hkv, d, generator=gen),
                           torch.randn(n, hkv, d, generator=gen))


def _per_request(pool: KVPool, rtt: ReqToTokenPool, fb: ForwardBatch, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype
                 ) -> torch.Tensor:
    """Each request alone: causal attention of its new tokens over its slots, in ``dtype``."""
    kb, vb = pool.k_buffers[0].clone(), pool.v_buffers[0].clone()
    kb[fb.out_cache_loc], vb[fb.out_cache_loc] = k, v
    out, start = [], 0
    for b, row in enumerate(fb.req_pool_indices.tolist()):
        prefix, seq_len = fb.prefix_lens_list[b], fb.seq_lens_list[b]
        ext = seq_len - prefix
        slots = rtt.table[row, :seq_len]
        qb = q[start:start + ext].to(dtype).transpose(0, 1)[None]
        keys = kb[slots].to(dtype).transpose(0, 1)[None]
        values = vb[slots].to(dtype).transpose(0, 1)[None]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None]
        res = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        out.append(res[0].transpose(0, 1))
        start += ext
    return torch.cat(out).float()


def _run(reqs: list[tuple[int, int]], hq: int = 8, hkv: int = 2, d: int = 64, seed: int = 0,
         **backend_kwargs):
    gen = torch.Generator().manual_seed(seed)
    pool, rtt, fb, (q, k, v) = _batch(gen, reqs, hq, hkv, d)
    scale = d ** -0.5
    ref = _per_request(pool, rtt, fb, q, k, v, scale, torch.float64)
    loop = _per_request(pool, rtt, fb, q, k, v, scale, torch.float32)
    backend = TorchNativeBackend(pool, rtt, **backend_kwargs)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, 0, scale, fb)
    return fb.attn_metadata, out, ref, loop


# a burst of multi-turn histories: prefixes of 400-500 tokens, 48 new tokens each (equal E,
# near-equal L: one group); and ragged ones (extends 2..40, prefixes 5..900: several groups)
HISTORIES = [(440 + 8 * i, 48) for i in range(10)]
RAGGED = [(5 + 97 * (i % 10), 2 + (13 * i) % 39) for i in range(14)]


@pytest.mark.parametrize("reqs", [HISTORIES, RAGGED], ids=["histories", "ragged"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 32), (6, 3, 128)])
def test_gathered_groups_match_reference(reqs, hq: int, hkv: int, d: int) -> None:
    meta, out, ref, loop = _run(reqs, hq, hkv, d)
    assert meta.fresh == [] and meta.single_tokens is None
    assert sum(g.num_reqs for g in meta.gathered) == len(reqs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL_REF, rtol=0)
    torch.testing.assert_close(out, loop, atol=TOL_LOOP, rtol=0)


def test_equal_histories_share_one_call() -> None:
    """Equal extends and near-equal lengths: one padded call, no query padding."""
    meta, *_ = _run(HISTORIES)
    assert len(meta.gathered) == 1
    group = meta.gathered[0]
    assert (group.num_reqs, group.ext_len, group.seq_len) == (10, 48, 440 + 8 * 9 + 48)
    assert group.real_rows is None


def test_ragged_lengths_are_cut_within_the_pad_budget() -> None:
    """Sorted by length and cut: a group of several requests costs at most the budget over
    its requests unpadded, every new token is computed by exactly one group, and the query
    padding rows are dropped."""
    meta, *_ = _run(RAGGED)
    assert len(meta.gathered) > 1
    starts, pos = {}, 0
    for p, e in RAGGED:
        starts[pos] = (p, e)
        pos += e
    covered = []
    for group in meta.gathered:
        members = [starts[int(s)] for s in group.q_index.view(group.num_reqs, -1)[:, 0]]
        assert group.ext_len == max(e for _, e in members)
        assert group.seq_len == max(p + e for p, e in members)
        unpadded = sum(e * (p + e) for p, e in members)
        padded = group.num_reqs * group.ext_len * group.seq_len
        assert group.num_reqs == 1 or padded <= torch_native._MAX_PAD_COST * unpadded
        assert group.token_index.numel() == sum(e for _, e in members)
        covered += group.token_index.tolist()
    assert sorted(covered) == list(range(pos))


def test_mixed_with_fresh_and_single_token_extends() -> None:
    """Gathered groups next to fresh prompts and one-token extends, with and without the
    paged kernel."""
    reqs = [(0, 30), (300, 20), (0, 30), (250, 1), (120, 7), (0, 1), (301, 20)]
    for kwargs in ({}, {"use_kernel": False}):
        meta, out, ref, _ = _run(reqs, seed=3, **kwargs)
        assert meta.gathered
        torch.testing.assert_close(out, ref, atol=TOL_REF, rtol=0)
