"""The C++ paged decode kernel (paged_decode) against the PyTorch reference decode path.

Batches are built the way the scheduler lays them out: page-aligned slot pages, GRPO-style
groups whose members share their prompt's pages (the radix cache's doing), ragged lengths, and
stale slots past each row's length. The kernel must match index_select + SDPA to 1e-5.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from rollout_engine_kernels.cpu import build
from rollout_engine_kernels.cpu import paged_decode as cpu_paged

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.torch_native import KERNEL_ENV, TorchNativeBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

TOL = 1e-5
MAX_LEN = 300


@pytest.fixture(scope="module")
def kernel() -> cpu_paged.PagedDecodeOp:
    op = cpu_paged.load_paged_decode()
    if op is None:
        pytest.fail("the CPU paged decode kernel did not build (see the warning logged above)")
    return op


@dataclass
class Case:
    pool: KVPool
    req_to_token: ReqToTokenPool
    fb: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor          # the new token's K/V, written by forward
    v: torch.Tensor


def make_case(gen: torch.Generator, groups: list[tuple[int, int]], *, hq: int, hkv: int,
              d: int, page_size: int, whole_share: bool = False) -> Case:
    """groups: (members, shared_len) each; shared_len is rounded down to whole pages (the radix
    cache shares only full pages). Each member then owns 1.. tokens of fresh pages (0 when
    ``whole_share``: members are the same row), up to MAX_LEN in all."""
    specs: list[tuple[int, list[int]]] = []          # (seq_len, slots)
    num_pages = 4 * MAX_LEN * sum(n for n, _ in groups) // page_size + 8
    pages = iter(torch.randperm(num_pages, generator=gen).tolist())

    def take(num_tokens: int) -> list[int]:
        out: list[int] = []
        for _ in range(-(-num_tokens // page_size)):
            p = next(pages)
            out += range(p * page_size, (p + 1) * page_size)
        return out[:num_tokens]

    for members, shared in groups:
        shared = shared // page_size * page_size
        prefix = take(shared)
        for _ in range(members):
            own = 0 if whole_share and shared else int(
                torch.randint(1, MAX_LEN - shared + 1, (1,), generator=gen))
            specs.append((shared + own, prefix + take(own)))
    order = torch.randperm(len(specs), generator=gen).tolist()     # groups not contiguous
    specs = [specs[i] for i in order]
    num_slots = num_pages * page_size
    pool = KVPool(num_slots, 1, hkv, d, torch.float32, torch.device("cpu"))
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rtt = ReqToTokenPool(2 * len(specs) + 4, MAX_LEN + 8, torch.device("cpu"))
    # stale slots past every row's length: planning and masking must ignore them
    rtt.table.random_(0, num_slots, generator=gen)
    row_ids = torch.randperm(rtt.size, generator=gen)[:len(specs)].tolist()
    for row, (_, slots) in zip(row_ids, specs):
        rtt.write(row, 0, slots)
    lens = [n for n, _ in specs]
    loc = [slots[n - 1] for n, slots in specs]
    b = len(specs)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=t([0] * b), positions=t([n - 1 for n in lens]),
        out_cache_loc=t(loc), req_pool_indices=t(row_ids), seq_lens=t(lens),
        prefix_lens=t([n - 1 for n in lens]), extend_lens=t([1] * b),
        logits_indices=t(list(range(b))), seq_lens_list=lens,
        prefix_lens_list=[n - 1 for n in lens], extend_lens_list=[1] * b)
    q = torch.randn(b, hq, d, generator=gen)
    k = torch.randn(b, hkv, d, generator=gen)
    v = torch.randn(b, hkv, d, generator=gen)
    return Case(pool, rtt, fb, q, k, v)


def decode(case: Case, **backend_kwargs) -> torch.Tensor:
    backend = TorchNativeBackend(case.pool, case.req_to_token, **backend_kwargs)
    backend.init_forward_metadata(case.fb)
    scale = case.q.shape[-1] ** -0.5
    return backend.forward(case.q, case.k, case.v, 0, scale, case.fb)


def assert_kernel_matches(case: Case) -> None:
    ref = decode(case, use_kernel=False)
    plain = decode(case, use_kernel=True, min_shared_len=None)
    cascade = decode(case, use_kernel=True)
    torch.testing.assert_close(plain, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(cascade, ref, atol=TOL, rtol=0)


# A GRPO-like mix: groups of 8 and 17 (over MAX_CHUNK_ROWS: split into chunks), 2 and 3, a
# group of 1, rows with no shared prefix, a prefix shorter than the cascade minimum.
MIXED = [(8, 128), (17, 64), (2, 200), (3, 33), (1, 100), (1, 0), (1, 0), (2, 8)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_kernel_matches_reference(kernel, hq: int, hkv: int, d: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(hq * 1000 + d * 10 + page_size)
    assert_kernel_matches(make_case(gen, MIXED, hq=hq, hkv=hkv, d=d, page_size=page_size))


# Every tile shape of the kernel: G = Hq / Hkv of 1, 2, 3 (tiles of 1 head), 4, 6 (tiles of
# 2), 8 (two tiles of 4), with one and three KV heads.
@pytest.mark.parametrize("hq,hkv", [(3, 3), (4, 2), (9, 3), (12, 3), (6, 1), (16, 2)])
def test_kernel_matches_reference_every_gqa_tile(kernel, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(hq * 100 + hkv)
    assert_kernel_matches(make_case(gen, MIXED, hq=hq, hkv=hkv, d=64, page_size=16))


def test_strided_queries_are_read_in_place(kernel) -> None:
    """q as the model passes it: a view into the fused qkv output (rows qkv-width apart)."""
    gen = torch.Generator().manual_seed(13)
    case = make_case(gen, MIXED, hq=8, hkv=2, d=64, page_size=16)
    fb, table = case.fb, case.req_to_token.table
    qkv = torch.randn(fb.batch_size, (8 + 2 * 2) * 64, generator=gen)
    q = qkv[:, :8 * 64].view(-1, 8, 64)
    assert not q.is_contiguous() and cpu_paged._rows_strided(q)
    k, v = case.pool.k_buffers[0], case.pool.v_buffers[0]
    plan = cpu_paged.plan_decode(table, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_list))
    out = cpu_paged.paged_decode(kernel, q, k, v, table, plan, 0.125)
    torch.testing.assert_close(
        out, cpu_paged.paged_decode(kernel, q.contiguous(), k, v, table, plan, 0.125),
        atol=0, rtol=0)
    torch.testing.assert_close(out, cpu_paged.paged_decode_ref(q, k, v, table, plan, 0.125),
                               atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="contiguous"):      # heads not contiguous
        kernel(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, table, plan.rows,
               plan.seq_lens, plan.own_start, plan.members, plan.chunk_offsets,
               plan.chunk_lens, 0.125)


def test_kernel_without_avx512_matches_reference(tmp_path, monkeypatch) -> None:
    """The AVX2 build (8 accumulator registers per tile instead of 16) on this machine's
    compiler, whatever the machine: the source compiled with -mno-avx512f (every development
    and CI machine has AVX2 and gcc, so a failed build fails the test)."""
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    path = build.build_library(cpu_paged.SOURCE, "paged_decode_avx2", ("-mno-avx512f",))
    op = cpu_paged.PagedDecodeOp(path)
    for hq, hkv in [(8, 2), (6, 2), (3, 1)]:
        gen = torch.Generator().manual_seed(hq)
        case = make_case(gen, MIXED, hq=hq, hkv=hkv, d=64, page_size=1)
        fb, table = case.fb, case.req_to_token.table
        k, v = case.pool.k_buffers[0], case.pool.v_buffers[0]
        for min_shared in (None, cpu_paged.DEFAULT_MIN_SHARED_LEN):
            plan = cpu_paged.plan_decode(table, fb.req_pool_indices, fb.seq_lens,
                                           max(fb.seq_lens_list), min_shared)
            out = cpu_paged.paged_decode(op, case.q, k, v, table, plan, 0.125)
            ref = cpu_paged.paged_decode_ref(case.q, k, v, table, plan, 0.125)
            torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_is_whole_sequence(kernel, page_size: int) -> None:
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, [(4, 96), (3, 17), (1, 40)], hq=8, hkv=2, d=64,
                     page_size=page_size, whole_share=True)
    assert_kernel_matches(case)


@pytest.mark.parametrize("d", cpu_paged.SUPPORTED_HEAD_DIMS)
def test_every_supported_head_dim(kernel, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    assert_kernel_matches(make_case(gen, [(4, 48), (1, 0), (1, 0)], hq=4, hkv=1, d=d,
                                    page_size=1))


def test_short_rows_and_singletons(kernel) -> None:
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen, [(1, 0)] * 9, hq=8, hkv=2, d=64, page_size=1)
    case.fb.seq_lens_list[0] = 1                      # a row of one token
    case.fb.seq_lens[0] = 1
    case.fb.out_cache_loc[0] = case.req_to_token.table[case.fb.req_pool_indices[0], 0]
    assert_kernel_matches(case)


def test_reference_plan_math_matches_kernel(kernel) -> None:
    """paged_decode_ref (PyTorch, float64) computes what the kernel does, plan included."""
    gen = torch.Generator().manual_seed(11)
    case = make_case(gen, MIXED, hq=8, hkv=2, d=64, page_size=16)
    fb, table = case.fb, case.req_to_token.table
    plan = cpu_paged.plan_decode(table, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_list))
    k, v = case.pool.k_buffers[0], case.pool.v_buffers[0]
    out = cpu_paged.paged_decode(kernel, case.q, k, v, table, plan, 0.125)
    ref = cpu_paged.paged_decode_ref(case.q, k, v, table, plan, 0.125)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


def _plan(groups: list[tuple[int, int]], page_size: int = 1, **kwargs
          ) -> tuple[cpu_paged.DecodePlan, Case]:
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, groups, hq=2, hkv=2, d=32, page_size=page_size)
    fb = case.fb
    plan = cpu_paged.plan_decode(case.req_to_token.table, fb.req_pool_indices, fb.seq_lens,
                                   max(fb.seq_lens_list), **kwargs)
    return plan, case


def test_plan_finds_groups() -> None:
    plan, case = _plan([(8, 128), (17, 64), (1, 100), (1, 0), (2, 8)])
    # 8 rows share 128; 17 rows share 64 as chunks of 16 + 1; the rest attend alone
    assert sorted(plan.chunk_lens.tolist()) == [64, 64, 128]
    assert sorted(torch.diff(plan.chunk_offsets).tolist()) == [1, 8, 16]
    assert plan.num_grouped_rows == 25
    assert sorted(plan.own_start.tolist()) == [0] * 4 + [64] * 17 + [128] * 8
    # the members of a chunk really share its prefix
    offsets = plan.chunk_offsets.tolist()
    for c, n in enumerate(plan.chunk_lens.tolist()):
        members = plan.members[offsets[c]:offsets[c + 1]]
        slots = case.req_to_token.table[plan.rows[members], :n]
        assert (slots == slots[0]).all() and (plan.seq_lens[members] >= n).all()


def test_plan_splits_an_outer_prefix_off_inner_groups() -> None:
    """Every row shares a 32-token system prompt; each group of 8 also shares its own 128:
    the plan keeps the inner groups (saving 7 x 128 reads each), not one group of 32."""
    gen = torch.Generator().manual_seed(9)
    system = list(range(32))
    rtt = ReqToTokenPool(32, 400, torch.device("cpu"))
    slot, lens = 1000, []
    for g in range(3):
        prompt = system + list(range(100 + 200 * g, 196 + 200 * g))        # 32 + 96 = 128
        for m in range(8):
            own = int(torch.randint(1, 60, (1,), generator=gen))
            rtt.write(g * 8 + m, 0, prompt + list(range(slot, slot + own)))
            slot += own
            lens.append(128 + own)
    rows, seq_lens = torch.arange(24), torch.tensor(lens)
    plan = cpu_paged.plan_decode(rtt.table, rows, seq_lens, max(lens))
    assert plan.chunk_lens.tolist() == [128, 128, 128]
    assert sorted(plan.own_start.tolist()) == [128] * 24


def test_plan_without_sharing() -> None:
    plan, _ = _plan([(1, 0)] * 5)
    assert plan.num_grouped_rows == 0 and plan.chunk_lens.numel() == 0
    plan, _ = _plan([(8, 128)], min_shared_len=None)
    assert plan.num_grouped_rows == 0
    plan, _ = _plan([(8, 12)])                 # shorter than the default minimum of 16
    assert plan.num_grouped_rows == 0


def test_fallback_when_the_kernel_cannot_build(monkeypatch, caplog) -> None:
    def broken() -> cpu_paged.PagedDecodeOp:
        raise RuntimeError("compiler exploded")

    # load_paged_decode as it is, over a builder that fails (the real cache stays untouched)
    monkeypatch.setattr(cpu_paged, "load_paged_decode",
                        functools.cache(lambda: cpu_paged._load(broken)))
    gen = torch.Generator().manual_seed(1)
    case = make_case(gen, [(4, 64), (1, 0)], hq=8, hkv=2, d=64, page_size=1)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        backend = TorchNativeBackend(case.pool, case.req_to_token)
        assert backend.decode_kernel is None
        TorchNativeBackend(case.pool, case.req_to_token)        # warns once, not twice
    warnings = [r for r in caplog.records if "kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "compiler exploded" in warnings[0].getMessage()
    torch.testing.assert_close(decode(case), decode(case, use_kernel=False), atol=0, rtol=0)


def test_reference_forced_by_env_and_unsupported_pools(kernel, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(2)
    case = make_case(gen, [(2, 32)], hq=4, hkv=2, d=64, page_size=1)
    assert TorchNativeBackend(case.pool, case.req_to_token).decode_kernel is not None
    monkeypatch.setenv(KERNEL_ENV, "0")
    assert TorchNativeBackend(case.pool, case.req_to_token).decode_kernel is None
    monkeypatch.delenv(KERNEL_ENV)
    bf16 = KVPool(64, 1, 2, 64, torch.bfloat16, torch.device("cpu"))
    assert TorchNativeBackend(bf16, case.req_to_token).decode_kernel is None
    odd = KVPool(64, 1, 2, 24, torch.float32, torch.device("cpu"))
    assert TorchNativeBackend(odd, case.req_to_token).decode_kernel is None


def test_build_directory_follows_the_cache_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    assert build._build_directory("x").startswith(str(tmp_path))
    monkeypatch.delenv("ROLLOUT_ENGINE_CACHE")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert build._build_directory("x").startswith(str(tmp_path / "torch"))


@pytest.mark.slow   # waits out a lock timeout
def test_a_stale_build_lock_does_not_hang_the_next_loader(kernel, monkeypatch, tmp_path) -> None:
    """A process killed mid-build leaves torch's lock file; the next load must still finish.
    (A fresh cache directory: a real build, ~4 s, and no other process's build to meet.)"""
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    name = build._kernel_name("rollout_engine_paged_decode")
    lock = Path(build._build_directory(name)) / "lock"
    lock.touch()
    code = ("from rollout_engine_kernels.cpu import paged_decode as c; "
            "assert c.load_paged_decode() is not None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[3])
    assert not lock.exists()


def test_malformed_plans_raise(kernel) -> None:
    """The kernel checks the plan before forming a pointer from it: errors, never a crash."""
    q, k, v = torch.randn(2, 4, 64), torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    table = torch.tensor([[0, 1, 2, 99], [0, 1, 5, 6]])
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    none = (t([]), t([0]), t([]))
    bad = [([4, 4], [0, 0], none, "slot 99 out of range"),
           ([3, 4], [2, 0], none, "own_start"),               # own part without a chunk
           ([3, 9], [0, 0], none, "length"),                  # longer than the table row
           ([3, 4], [2, 2], (t([0, 0]), t([0, 2]), t([2])), "chunk member")]
    for lens, own, (members, offsets, chunk_lens), match in bad:
        with pytest.raises(RuntimeError, match=match):
            kernel(q, k, v, table, t([0, 1]), t(lens), t(own), members, offsets, chunk_lens, 0.1)
    out = kernel(q, k, v, table, t([0, 1]), t([3, 4]), t([2, 2]), t([0, 1]), t([0, 2]), t([2]),
                 0.1)
    assert torch.isfinite(out).all()
