"""EXTEND attention of the CPU backend against a float64 reference over the pool.

A batch mixes the three ways ``TorchNativeBackend`` splits a prefill: requests without a cached
prefix (fresh k/v, equal lengths batched into one SDPA call), requests adding one token to a
cached prefix (GRPO siblings on a radix hit: decode rows for the paged kernel, with groups
sharing their prompt's slots) and requests adding several tokens to a cached prefix (gathered).
"""

from __future__ import annotations

import pytest
import torch

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

TOL = 1e-5


def _batch(gen: torch.Generator, reqs: list[tuple[int, int, int]], hq: int, hkv: int, d: int):
    """reqs: (prefix_len, extend_len, group) each; requests of one group > 0 share the slots of
    their first ``prefix_len`` positions (one prompt, several samples)."""
    max_len = max(p + e for p, e, _ in reqs) + 1
    num_slots = 2 * max_len * len(reqs) + 8
    pool = KVPool(num_slots, 1, hkv, d, torch.float32, torch.device("cpu"))
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rtt = ReqToTokenPool(len(reqs) + 4, max_len + 8, torch.device("cpu"))
    rtt.table.random_(0, num_slots, generator=gen)      # stale slots past every row
    free = iter(torch.randperm(num_slots, generator=gen).tolist())
    shared: dict[int, list[int]] = {}
    rows, out_loc = [], []
    for prefix, ext, group in reqs:
        if group and group in shared:
            head = shared[group][:prefix]
        else:
            head = [next(free) for _ in range(prefix)]
            if group:
                shared[group] = head
        new = [next(free) for _ in range(ext)]
        row = rtt.allocate()
        rtt.write(row, 0, head + new)
        rows.append(row)
        out_loc += new
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    prefix_lens = [p for p, _, _ in reqs]
    ext_lens = [e for _, e, _ in reqs]
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    num_tokens = sum(ext_lens)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=t([0] * num_tokens),
        positions=t([p for pl, e in zip(prefix_lens, ext_lens) for p in range(pl, pl + e)]),
        out_cache_loc=t(out_loc), req_pool_indices=t(rows), seq_lens=t(seq_lens),
        prefix_lens=t(prefix_lens), extend_lens=t(ext_lens),
        logits_indices=t([num_tokens - 1]), seq_lens_list=seq_lens,
        prefix_lens_list=prefix_lens, extend_lens_list=ext_lens)
    q = torch.randn(num_tokens, hq, d, generator=gen)
    k = torch.randn(num_tokens, hkv, d, generator=gen)
    v = torch.randn(num_tokens, hkv, d, generator=gen)
    return pool, rtt, fb, q, k, v


def _reference(pool: KVPool, rtt: ReqToTokenPool, fb: ForwardBatch, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 causal attention of each request's new tokens over its slots in the pool."""
    kb, vb = pool.k_buffers[0].clone(), pool.v_buffers[0].clone()
    kb[fb.out_cache_loc], vb[fb.out_cache_loc] = k, v
    hq, hkv = q.shape[1], k.shape[1]
    out, start = [], 0
    for b, row in enumerate(fb.req_pool_indices.tolist()):
        prefix, seq_len = fb.prefix_lens_list[b], fb.seq_lens_list[b]
        ext = seq_len - prefix
        slots = rtt.table[row, :seq_len]
        keys = kb[slots].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        values = vb[slots].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qb = q[start:start + ext].double().transpose(0, 1)             # [Hq, E, D]
        s = qb @ keys.transpose(1, 2) * scale                           # [Hq, E, L]
        causal = torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None]
        s = s.masked_fill(~causal, -torch.inf)
        out.append((s.softmax(-1) @ values).transpose(0, 1))
        start += ext
    return torch.cat(out).float()


def _check(reqs: list[tuple[int, int, int]], hq: int = 8, hkv: int = 2, d: int = 64,
           seed: int = 0, **backend_kwargs) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool, rtt, fb, q, k, v = _batch(gen, reqs, hq, hkv, d)
    scale = d ** -0.5
    ref = _reference(pool, rtt, fb, q, k, v, scale)
    backend = TorchNativeBackend(pool, rtt, **backend_kwargs)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, 0, scale, fb)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


# GRPO's prefill: fresh prompts (equal lengths: one SDPA call), then siblings adding their last
# token to the cached prompt (groups of 7 sharing 127 slots), plus the odd cases.
GRPO = [(0, 128, 0)] * 4 + [(127, 1, g) for g in (1, 2, 3) for _ in range(7)]
MIXED = ([(0, 17, 0), (0, 17, 0), (0, 5, 0), (0, 1, 0), (0, 1, 0), (40, 9, 0), (64, 1, 4),
          (64, 1, 4), (3, 1, 0), (0, 33, 0), (100, 20, 5), (100, 1, 5), (0, 17, 0)]
         + [(30, 1, 6)] * 18)


@pytest.mark.parametrize("reqs", [GRPO, MIXED], ids=["grpo", "mixed"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 32), (6, 3, 128)])
def test_extend_matches_reference(reqs, hq: int, hkv: int, d: int) -> None:
    _check(reqs, hq, hkv, d)


@pytest.mark.parametrize("kwargs", [{"use_kernel": False}, {"min_shared_len": None}],
                         ids=["no-kernel", "no-cascade"])
def test_extend_without_kernel_or_cascade(kwargs) -> None:
    _check(MIXED, seed=1, **kwargs)


def test_prefill_sized_fresh_runs() -> None:
    """4096 tokens of fresh prompts (32 x 128) and ragged lengths in one batch."""
    _check([(0, 128, 0)] * 32, hq=8, hkv=2, d=64, seed=2)
    _check([(0, n, 0) for n in (1, 2, 3, 64, 64, 65, 200, 7)], seed=3)


# ---- fresh prompts through the compiled causal kernel (PagedDecodeOp.prefill_causal) ---------

def _fused_views(gen: torch.Generator, tokens: int, hq: int, hkv: int, d: int):
    """q, k, v as the model hands them over: row-strided views into one fused qkv output."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    return q, k, v


def _causal_reference(q, k, v, n: int, scale: float) -> torch.Tensor:
    tokens, hq, d = q.shape
    e, g = tokens // n, hq // k.shape[1]
    qd, kd, vd = (t.double().reshape(n, e, -1, d).transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
    s = qd @ kd.transpose(-1, -2) * scale
    s = s.masked_fill(~torch.ones(e, e, dtype=torch.bool).tril(), -torch.inf)
    return (s.softmax(-1) @ vd).transpose(1, 2).reshape(tokens, hq, d).float()


@pytest.mark.parametrize("n,e,hq,hkv,d", [(16, 128, 8, 2, 64), (3, 1, 4, 4, 32), (2, 100, 8, 2, 64),
                                          (5, 33, 6, 2, 16), (1, 300, 4, 1, 128),
                                          (2, 31, 2, 1, 256)])
def test_causal_kernel_matches_reference(n: int, e: int, hq: int, hkv: int, d: int) -> None:
    from rollout_engine_kernels.cpu.paged_decode import load_paged_decode

    op = load_paged_decode()
    assert op is not None and op.has_prefill_causal
    gen = torch.Generator().manual_seed(n * e + d)
    q, k, v = _fused_views(gen, n * e, hq, hkv, d)
    out = torch.full((n * e, hq, d), float("nan"))
    op.prefill_causal(q, k, v, n, d ** -0.5, out)
    torch.testing.assert_close(out, _causal_reference(q, k, v, n, d ** -0.5), atol=TOL, rtol=0)


def test_causal_kernel_refuses_bad_shapes() -> None:
    from rollout_engine_kernels.cpu.paged_decode import load_paged_decode

    op = load_paged_decode()
    q, k, v = _fused_views(torch.Generator().manual_seed(0), 12, 4, 2, 32)
    with pytest.raises(ValueError, match="disagree"):
        op.prefill_causal(q, k, v, 5, 1.0, torch.empty(12, 4, 32))       # 12 tokens, 5 prompts
    with pytest.raises(ValueError, match="disagree"):
        op.prefill_causal(q, k, v, 2, 1.0, torch.empty(12, 4, 64)[..., :32])   # strided out
    with pytest.raises(ValueError, match="float32"):
        op.prefill_causal(q.double(), k, v, 2, 1.0, torch.empty(12, 4, 32))
    with pytest.raises(RuntimeError, match="head_dim"):
        q3, k3, v3 = _fused_views(torch.Generator().manual_seed(0), 4, 2, 1, 24)
        op.prefill_causal(q3, k3, v3, 2, 1.0, torch.empty(4, 2, 24))


def test_fresh_runs_take_the_kernel_not_sdpa(monkeypatch) -> None:
    """The backend's fresh prompts (strided views, as the model passes them) go through the
    kernel: SDPA is made to fail, and the result still equals the float64 reference."""
    import rollout_engine.model_runner.attention.torch_native as tn

    def no_sdpa(*args, **kwargs):
        raise AssertionError("SDPA was called for a fresh run")

    monkeypatch.setattr(tn.F, "scaled_dot_product_attention", no_sdpa)
    gen = torch.Generator().manual_seed(7)
    reqs = [(0, 128, 0)] * 3 + [(0, 40, 0)] * 2
    pool, rtt, fb, _, _, _ = _batch(gen, reqs, 8, 2, 64)
    q, k, v = _fused_views(gen, fb.out_cache_loc.numel(), 8, 2, 64)
    ref = _reference(pool, rtt, fb, q, k, v, 0.125)
    backend = TorchNativeBackend(pool, rtt)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, k, v, 0, 0.125, fb), ref, atol=TOL, rtol=0)
