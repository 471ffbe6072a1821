"""Sections of ``gpu_check.py`` (kernels, bandwidth, end-to-end, sleep, refit) and their context.

Each section returns a ``Section``: table rows ``[metric, value, detail, note]`` plus raw data
for the JSON. On ``--cpu-dry-run`` the same code runs with tiny sizes on CPU (Triton in its
interpreter), so the plumbing is tested without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import common
import torch

# ~0.5B parameters: 24 x 19.9M per layer + a tied 32.8M embedding
BIG_QWEN2 = dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4,
                 intermediate_size=5632, vocab_size=32000)


@dataclass
class Section:
    rows: list[list[Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ok: bool = True
    skipped: bool = False

    def row(self, metric: str, value: Any, detail: str = "", note: str = "") -> None:
        self.rows.append([metric, value, detail, note])

    def status(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "fail")


@dataclass
class Ctx:
    """What the sections share: sizes (dry run or GPU), and one process-mode engine on the
    ~0.5B model for the sleep and refit sections."""

    dry: bool
    _big_engine: Optional[Any] = None

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.dry else "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def engine_flags(self) -> dict[str, Any]:
        return dict(device=self.device, dtype=self.dtype, scheduler_mode="thread", random_seed=0)

    def big_model_path(self) -> str:
        from rollout_engine.testing.tiny_model import tiny_model_path

        return str(tiny_model_path("qwen2") if self.dry else tiny_model_path("qwen2", **BIG_QWEN2))

    def big_engine(self) -> Any:
        """Process-mode engine (tensors cross a real process boundary), weights backed up on
        the host so a wake restores them."""
        if self._big_engine is None:
            from rollout_engine import Engine

            self._big_engine = Engine(
                model_path=self.big_model_path(), **{**self.engine_flags(), "scheduler_mode":
                                                     "thread" if self.dry else "process"},
                enable_weights_cpu_backup=True, max_total_tokens=4096 if self.dry else 131072)
        return self._big_engine

    def close(self) -> None:
        if self._big_engine is not None:
            self._big_engine.shutdown()
            self._big_engine = None


def human_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.2f} MB"


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timeit(ctx: Ctx, fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median seconds per call (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if ctx.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_seconds(ctx: Ctx, nbytes: int, reps: int) -> float:
    """Median time of one device ``copy_`` of ``nbytes`` (reads and writes that much each)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return timeit(ctx, lambda: dst.copy_(src), reps=reps)


# -- kernels vs references -------------------------------------------------------------------------
def make_pool(lens: list[int], hkv: int, d: int, dtype: torch.dtype, dev: str, seed: int = 0):
    """Random K/V pool, slots permuted (page size 1 after churn); rows 1..B of the table."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    slots = torch.randperm(total, generator=g) + 1
    k = torch.randn(total + 1, hkv, d, generator=g)
    v = torch.randn(total + 1, hkv, d, generator=g)
    table = torch.zeros(len(lens) + 2, max(lens) + 3, dtype=torch.int64)
    used = 0
    for b, n in enumerate(lens):
        table[b + 1, :n] = slots[used:used + n]
        used += n
    rows = torch.arange(1, len(lens) + 1)
    return (k.to(dev, dtype), v.to(dev, dtype), table.to(dev), rows.to(dev))


# -- bandwidth ------------------------------------------------------------------------------------
def bandwidth(ctx: Ctx) -> Section:
    from rollout_engine_kernels.triton.decode_attention import decode_attention

    sec = Section()
    dev = ctx.device
    nbytes = (64 << 20) if ctx.dry else (2 << 30)
    copy_gbps = 2 * nbytes / copy_seconds(ctx, nbytes, reps=3 if ctx.dry else 10) / 1e9
    sec.row("copy_ bandwidth", f"{copy_gbps:.0f} GB/s", f"{nbytes >> 20} MiB, read + write")

    batch, seq, hq, hkv, d = (2, 16, 4, 2, 16) if ctx.dry else (64, 4096, 32, 8, 128)
    k, v, table, rows = make_pool([seq] * batch, hkv, d, ctx.torch_dtype, dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=ctx.torch_dtype)
    seq_lens = torch.full((batch,), seq, device=dev)
    kv_bytes = 2 * batch * seq * hkv * d * k.element_size()
    t = timeit(ctx, lambda: decode_attention(q, k, v, table, rows, seq_lens, d ** -0.5),
               reps=2 if ctx.dry else 20)
    gbps = kv_bytes / t / 1e9
    shape = f"B={batch} L={seq} Hq={hq} Hkv={hkv} D={d} {ctx.dtype}, permuted slots"
    sec.row("decode attention (triton)", f"{gbps:.0f} GB/s", shape,
            f"{gbps / copy_gbps:.0%} of copy_ ({t * 1e3:.3f} ms)")
    sec.data.update(copy_gbps=copy_gbps, kv_bytes=kv_bytes, triton_seconds=t, triton_gbps=gbps)
    fi = _flashinfer_decode(q, k, v, table, rows, seq_lens) if not ctx.dry else None
    if fi is not None:
        t_fi = timeit(ctx, fi, reps=20)
        sec.row("decode attention (flashinfer)", f"{kv_bytes / t_fi / 1e9:.0f} GB/s", shape,
                f"{kv_bytes / t_fi / 1e9 / copy_gbps:.0%} of copy_ ({t_fi * 1e3:.3f} ms)")
        sec.data.update(flashinfer_seconds=t_fi)
    if ctx.dry:
        sec.notes.append("CPU dry run: Triton interpreter, timings are meaningless")
    return sec


def _flashinfer_decode(q, k, v, table, rows, seq_lens) -> Optional[Callable[[], Any]]:
    try:
        import flashinfer
    except ImportError:
        return None
    from rollout_engine.model_runner.attention.flashinfer_backend import kv_indices_from_table

    lens = seq_lens.tolist()
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    indices = kv_indices_from_table(table, rows, seq_lens, lens)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    group = q.shape[1] // k.shape[1]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                            use_tensor_cores=group >= 4)
    wrapper.plan(indptr, indices, torch.ones(len(lens), dtype=torch.int32), q.shape[1],
                 k.shape[1], k.shape[2], 1, q_data_type=q.dtype, kv_data_type=k.dtype,
                 sm_scale=k.shape[2] ** -0.5)
    paged = (k.unsqueeze(1), v.unsqueeze(1))
    return lambda: wrapper.run(q, paged)


# -- end to end -----------------------------------------------------------------------------------
def e2e(ctx: Ctx) -> Section:
    from bench_offline import make_prompts

    from rollout_engine import Engine

    sec = Section()
    path = ctx.big_model_path()
    params = common.model_params(path)
    num, n, prompt_len, new = (2, 2, 8, 4) if ctx.dry else (32, 8, 256, 256)
    prompts = make_prompts(num, prompt_len, 512 if ctx.dry else 32000, seed=0)
    sp = {"n": n, "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True,
          "sampling_seed": 1234}
    seqs = num * n
    engine = Engine(model_path=path, **ctx.engine_flags(), max_running_requests=max(seqs, 8),
                    cuda_graph_max_bs=max(seqs, 8), max_total_tokens=seqs * (prompt_len + new) * 2)
    try:
        engine.generate(input_ids=[p[:16] for p in prompts[:2]],
                        sampling_params={**sp, "n": 2, "max_new_tokens": 4})
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        stats = engine.get_server_info()["stats"]
    finally:
        engine.shutdown()
    gen = sum(len(o["output_ids"]) for o in outs)
    free_device_memory()
    hf_wall, hf_gen = _hf_generate(ctx, path, prompts, n, new)
    ours, theirs = gen / wall, hf_gen / hf_wall
    size = f"qwen2 {params['total'] / 1e6:.0f}M params, {ctx.dtype}"
    work = f"{num} prompts x n={n}, {prompt_len}+{new} tokens, T=1"
    sec.row("rollout engine", f"{ours:.0f} tok/s", work, size)
    sec.row("transformers.generate", f"{theirs:.0f} tok/s", work, "one generate call, sdpa")
    sec.row("engine / transformers", f"{ours / theirs:.2f}x", "", "side by side, same run")
    sec.data.update(params=params, engine_tok_s=ours, hf_tok_s=theirs, engine_wall_s=wall,
                    hf_wall_s=hf_wall, generated=gen, stats=stats, ratio=ours / theirs)
    return sec


def _hf_generate(ctx: Ctx, path: str, prompts: list[list[int]], n: int, new: int
                 ) -> tuple[float, int]:
    from rollout_engine.testing.parity import load_hf

    model = load_hf(path, ctx.torch_dtype, ctx.device)
    ids = torch.tensor(prompts, device=ctx.device)
    kw = dict(do_sample=True, num_return_sequences=n, max_new_tokens=new, min_new_tokens=new,
              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:2, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gen = out.shape[0] * (out.shape[1] - ids.shape[1])
    del model
    free_device_memory()
    return wall, gen


# -- sleep / wake and refit -----------------------------------------------------------------------
def _greedy(engine: Any, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, engine.tm.vocab_size, (4, 32), generator=g).tolist()
    engine.flush_cache()   # cold cache each time: a cached prefix changes bf16 rounding
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                               "max_new_tokens": 16})
    return [o["output_ids"] for o in outs]


def _free_bytes(ctx: Ctx) -> Optional[int]:
    if ctx.device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def sleep_wake(ctx: Ctx) -> Section:
    sec = Section()
    engine = ctx.big_engine()
    before = _greedy(engine)
    info = engine.get_server_info()
    expected = info["weight_bytes"] + info["kv_pool_bytes"]
    free0 = _free_bytes(ctx)
    res = engine.release_memory_occupation()
    free1 = _free_bytes(ctx)
    engine.resume_memory_occupation()
    free2 = _free_bytes(ctx)
    after = _greedy(engine)
    sec.row("engine-reported bytes freed", human_bytes(res["bytes_freed"]),
            f"expected weights + KV {human_bytes(expected)}", f"release {res['seconds']:.2f} s")
    if free0 is not None and free1 is not None and free2 is not None:
        freed = free1 - free0
        sec.row("device bytes freed (mem_get_info)", human_bytes(freed),
                f"{freed / expected:.0%} of weights + KV",
                f"re-taken on wake {human_bytes(free1 - free2)}")
        sec.data.update(device_freed=freed, device_retaken=free1 - free2)
        sec.ok &= freed >= 0.9 * expected
    else:
        sec.notes.append("CPU: torch.cuda.mem_get_info unavailable; engine-reported bytes only")
    same = before == after
    sec.row("greedy tokens equal after wake", str(same), "weights from the host backup",
            "graphs recaptured" if ctx.device == "cuda" else "")
    sec.ok &= same
    sec.data.update(reported=res["bytes_freed"], expected=expected, tokens_equal=same)
    return sec


def refit(ctx: Ctx) -> Section:
    from rollout_engine.protocol.bucket import pack_buckets
    from rollout_engine.weights.loader import iter_safetensors

    sec = Section()
    engine = ctx.big_engine()
    engine.resume_memory_occupation()          # a no-op unless the sleep section failed midway
    before = _greedy(engine)
    named = [(name, t.to(ctx.device, ctx.torch_dtype).contiguous())
             for name, t in iter_safetensors(ctx.big_model_path())]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    reps = 1 if ctx.dry else 3
    results = {}
    for mode in ("direct", "flattened_bucket"):
        best = math.inf
        for _ in range(reps):
            payload = (named if mode == "direct"
                       else list(pack_buckets(named, 512 << 20)))
            if ctx.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ok, msg = engine.update_weights_from_tensor(
                payload, load_format=None if mode == "direct" else mode)
            best = min(best, time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"update_weights_from_tensor ({mode}) failed: {msg}")
        results[mode] = nbytes / best / 1e9
    memcpy = nbytes / copy_seconds(ctx, nbytes, reps=5) / 1e9
    transport = "CUDA IPC, parent -> scheduler process" if ctx.device == "cuda" else \
        "CPU dry run: shared memory, thread mode"
    for mode, gbps in results.items():
        sec.row(f"refit {mode}", f"{gbps:.1f} GB/s", transport,
                f"{gbps / memcpy:.2f}x of a device memcpy of the same {human_bytes(nbytes)}")
    sec.row("device memcpy (same bytes)", f"{memcpy:.0f} GB/s", "one copy_", "")
    same = _greedy(engine) == before
    sec.row("greedy tokens equal after refit", str(same), "same weights sent back", "")
    sec.ok &= same
    sec.data.update(bytes=nbytes, gbps=results, memcpy_gbps=memcpy, tokens_equal=same)
    ctx.close()
    return sec
