"""CPU paged decode attention: a C++ kernel that reads K/V from the pool in place, with
shared-prefix (cascade) attention for rows that share their first slots, and its reference.

Cascade (Hydragen) attention. In a GRPO batch the samples of one prompt share the prompt's KV
slots (the radix cache hands siblings the same pages), so their slot rows agree on a prefix:

    row r0:  | s0 s1 ... s127 | a0 a1 ... a70 |        shared prefix: slots [0, p)
    row r1:  | s0 s1 ... s127 | b0 b1 ... b95 |        own suffix:    slots [p, seq_len)
    ...

Attention of one query row q over keys split into two parts P (prefix) and O (own) is

    out = (sum_{j in P} e^{s_j} v_j + sum_{j in O} e^{s_j} v_j) / (sum_{j in P} e^{s_j} + sum_{j in O} e^{s_j})

with s_j = scale * q . k_j. Each part is kept as an online-softmax state (m, l, acc):
m = max_j s_j, l = sum_j e^{s_j - m}, acc = sum_j e^{s_j - m} v_j. Two states merge exactly by
log-sum-exp: m = max(m1, m2), l = l1 e^{m1 - m} + l2 e^{m2 - m}, acc likewise, out = acc / l.
So the prefix part of every member of a group (n rows x G query heads per KV head) is computed
as one batched product against the prefix keys, read once instead of n times, and each row then
continues from that state over its own suffix. The kernel (``paged_decode.cpp``) does both
phases; ``paged_decode_ref`` below does the same in PyTorch, for tests.

Built and loaded by ``build`` (compiled at first use, cached); if it cannot be built,
``load_paged_decode`` logs one warning and returns None, and the caller keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "paged_decode.cpp"
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
DEFAULT_MIN_SHARED_LEN = 16     # shorter shared prefixes are not worth a separate pass
MAX_CHUNK_ROWS = 16             # group members per prefix task: bounds the task's scratch


class PagedDecodeOp:
    """The compiled kernel: a C function over raw pointers, called through ctypes (which
    releases the GIL while it runs). Checks what the C side cannot see (dtypes, shapes,
    contiguity); the C side checks the plan's values and every slot it reads."""

    ABI = 2   # rollout_engine_paged_decode_abi() of the source these signatures describe

    def __init__(self, library_path: str) -> None:
        self._lib = build.open_library(library_path, "rollout_engine_paged_decode_abi", self.ABI)
        fn = self._lib.rollout_engine_paged_decode_f32
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 10 + [ctypes.c_int64] * 10
                       + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64])
        self._fn = fn
        # the causal prefill entry (a library built before it has none: SDPA stays in use)
        causal = getattr(self._lib, "rollout_engine_prefill_causal_f32", None)
        if causal is not None:
            causal.restype = ctypes.c_int
            causal.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7
                               + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p,
                                  ctypes.c_int64])
        self._causal = causal

    @property
    def has_prefill_causal(self) -> bool:
        return self._causal is not None

    def prefill_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int,
                       scale: float, out: torch.Tensor) -> None:
        """Causal attention of ``n`` fresh prompts of equal length (no cached prefix), written
        into ``out`` ``[n * e, Hq, D]`` (contiguous): token i of a prompt over keys 0..i of
        the same prompt. q ``[n * e, Hq, D]``, k and v ``[n * e, Hkv, D]`` float32 on CPU, their
        heads and dims contiguous and rows any stride apart (views into the fused qkv output),
        k and v with the same row stride."""
        if self._causal is None:
            raise RuntimeError("prefill_causal: the loaded kernel library predates it")
        for t in (q, k, v, out):
            if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 3:
                raise ValueError("prefill_causal: q, k, v, out must be 3-D float32 on CPU")
        tokens, hq, d = q.shape
        hkv = k.shape[1]
        if not (n >= 1 and tokens % n == 0 and k.shape == v.shape == (tokens, hkv, d)
                and out.shape == q.shape and out.is_contiguous() and hkv >= 1 and hq % hkv == 0
                and _rows_strided(q) and _rows_strided(k) and _rows_strided(v)
                and k.stride(0) == v.stride(0)):
            raise ValueError(f"prefill_causal: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}, out {tuple(out.shape)} for {n} prompts "
                             "disagree or are not row-strided")
        if tokens == 0:
            return
        err = ctypes.create_string_buffer(256)
        rc = self._causal(q.data_ptr(), k.data_ptr(), v.data_ptr(), n, tokens // n, hq, hkv, d,
                          q.stride(0), k.stride(0), scale, out.data_ptr(), err, len(err))
        if rc:
            raise RuntimeError(err.value.decode(errors="replace"))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                 rows: torch.Tensor, seq_lens: torch.Tensor, own_start: torch.Tensor,
                 members: torch.Tensor, chunk_offsets: torch.Tensor, chunk_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Row b of q ``[B, Hq, D]`` over its slots; see ``DecodePlan`` for the index tensors.
        q's rows may be strided (a view into the fused qkv output: heads and dims contiguous)."""
        for t in (q, k, v):
            if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 3:
                raise ValueError("paged_decode: q, k, v must be 3-D float32 on CPU")
        if not (k.is_contiguous() and v.is_contiguous() and _rows_strided(q)):
            raise ValueError("paged_decode: k and v must be contiguous, q's heads and dims too")
        if k.shape != v.shape or q.shape[2] != k.shape[2]:
            raise ValueError(f"paged_decode: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)} disagree")
        out = torch.empty(q.shape, dtype=q.dtype)
        self.prepared(table, DecodePlan(rows, seq_lens, own_start, members, chunk_offsets,
                                        chunk_lens), q.shape[0], q.shape[1], k.shape[1],
                      q.shape[2])(q.data_ptr(), q.stride(0), k, v, scale, out.data_ptr())
        return out

    def prepared(self, table: torch.Tensor, plan: DecodePlan, batch: int, num_heads: int,
                 num_kv_heads: int, head_dim: int
                 ) -> Callable[[int, int, torch.Tensor, torch.Tensor, float, int], None]:
        """The kernel for one decode step's plan, checked once for all its layers:
        ``attend(q_ptr, q_row_stride, k, v, scale, out_ptr)`` writes row b's attention of
        q ``[batch, num_heads, head_dim]`` (float32 at q_ptr, rows q_row_stride floats apart,
        heads and dims contiguous) into out ``[batch, num_heads, head_dim]`` (contiguous), over
        one layer's pool buffers k, v ``[num_slots + 1, num_kv_heads, head_dim]``, which are
        checked at every call (cheaply: they are the pool's)."""
        index = (table, plan.rows, plan.seq_lens, plan.own_start, plan.members,
                 plan.chunk_offsets, plan.chunk_lens)
        for t in index:
            if t.dtype is not torch.int64 or not t.is_cpu or not t.is_contiguous():
                raise ValueError("paged_decode: index tensors must be contiguous int64 on CPU")
        if table.dim() != 2 or any(t.shape != (batch,) for t in index[1:4]) \
                or plan.chunk_offsets.shape != (plan.chunk_lens.numel() + 1,):
            raise ValueError("paged_decode: index tensor shapes disagree with the batch")
        ptrs = [t.data_ptr() for t in index]
        sizes = (batch, num_heads, num_kv_heads, head_dim)
        tail = (table.shape[0], table.shape[1], plan.members.numel(), plan.chunk_lens.numel())
        shape = (num_kv_heads, head_dim)
        err = ctypes.create_string_buffer(256)
        fn = self._fn

        def attend(q_ptr: int, q_stride: int, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_ptr: int) -> None:
            if not (k.dtype is torch.float32 and v.dtype is torch.float32 and k.is_cpu
                    and k.shape[1:] == shape and v.shape == k.shape and k.is_contiguous()
                    and v.is_contiguous()):
                raise ValueError(f"paged_decode: k {tuple(k.shape)} / v {tuple(v.shape)} must be "
                                 f"contiguous float32 [slots, {num_kv_heads}, {head_dim}]")
            if q_stride < num_heads * head_dim:
                raise ValueError(f"paged_decode: q row stride {q_stride} under a row")
            rc = fn(q_ptr, k.data_ptr(), v.data_ptr(), *ptrs, *sizes, k.shape[0], *tail,
                    q_stride, scale, out_ptr, err, len(err))
            if rc:
                raise RuntimeError(err.value.decode(errors="replace"))

        return attend


def _rows_strided(q: torch.Tensor) -> bool:
    """Whether ``q [B, H, D]`` has contiguous heads and dims, its rows any stride apart."""
    b, h, d = q.shape
    return (d <= 1 or q.stride(2) == 1) and (h <= 1 or q.stride(1) == d) and \
        (b <= 1 or q.stride(0) >= h * d)


def _build() -> PagedDecodeOp:
    """Compile (or, when up to date, just load) the kernel; raises on any failure."""
    return PagedDecodeOp(build.build_library(SOURCE, "rollout_engine_paged_decode"))


@functools.cache
def load_paged_decode() -> Optional[PagedDecodeOp]:
    """The compiled kernel, or None (after one warning) when it cannot be built or loaded."""
    return _load(_build)


def _load(builder: Callable[[], PagedDecodeOp]) -> Optional[PagedDecodeOp]:
    return build.load_or_warn(builder, "CPU paged decode attention kernel",
                              "using the PyTorch path")


def kernel_supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and head_dim in SUPPORTED_HEAD_DIMS


@dataclass
class DecodePlan:
    """Which rows share which prefix, as the kernel's index tensors (all int64).

    Members of a group are split into chunks of at most ``MAX_CHUNK_ROWS`` rows; chunk c is the
    batch rows ``members[chunk_offsets[c]:chunk_offsets[c + 1]]``, which share the slots
    ``table[rows[members[chunk_offsets[c]]], :chunk_lens[c]]``. Row b then attends to its own
    slots ``[own_start[b], seq_lens[b])``; ``own_start[b]`` is 0 for a row in no group.
    """

    rows: torch.Tensor            # [B] req_to_token rows
    seq_lens: torch.Tensor        # [B]
    own_start: torch.Tensor       # [B]
    members: torch.Tensor         # [M] batch indices of grouped rows, chunk by chunk
    chunk_offsets: torch.Tensor   # [num_chunks + 1]
    chunk_lens: torch.Tensor      # [num_chunks] shared prefix length of each chunk

    @property
    def num_grouped_rows(self) -> int:
        return int(self.members.numel())


def _empty_plan(rows: torch.Tensor, seq_lens: torch.Tensor) -> DecodePlan:
    z = torch.zeros(0, dtype=torch.int64)
    return DecodePlan(rows, seq_lens, torch.zeros_like(seq_lens), z, torch.zeros(1, dtype=torch.int64), z)


def plan_decode(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                min_shared_len: Optional[int] = DEFAULT_MIN_SHARED_LEN) -> DecodePlan:
    """Find groups of decode rows whose slot rows start with the same slots (CPU tensors).

    Rows are put in lexicographic order of their (masked) slot rows, so rows sharing a prefix
    are neighbours, and ``lcp[i]`` = common prefix length of sorted neighbours i and i + 1. A
    group is a run of neighbours; it shares the minimum lcp inside it. The run is cut where
    ``lcp < min_shared_len``, and also where lcp is under half a neighbouring lcp: then that
    pair shares only an outer prefix (say a system prompt common to every group) and keeping
    the inner groups (each prompt's samples) saves more reads. ``min_shared_len=None`` plans
    no sharing (every row attends to its whole row on its own).
    """
    rows = rows.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    num_rows = int(rows.numel())
    if min_shared_len is None or num_rows < 2 or max_len < min_shared_len:
        return _empty_plan(rows, seq_lens)
    # numpy: a few hundred rows, where torch's per-op overhead would dominate (~3x slower)
    lens = seq_lens.numpy()
    slots = table.numpy()[rows.numpy(), :max_len]                       # [B, L]
    if np.unique(slots[:, 0]).size == num_rows:                         # no two rows share slot 0
        return _empty_plan(rows, seq_lens)
    # Past its length (and in one extra column) each row holds a value of its own, so two rows
    # always differ somewhere and their first difference is where their common prefix ends.
    # Big-endian uint32 rows compare as byte strings in number order: one argsort sorts them.
    pad = (np.iinfo(np.uint32).max - np.arange(num_rows))[:, None]
    inside = np.arange(max_len + 1)[None, :] < lens[:, None]
    key = np.where(inside, np.pad(slots, ((0, 0), (0, 1))), pad).astype(">u4")
    order = np.argsort(key.view(np.dtype((np.void, key.shape[1] * 4))).ravel(), kind="stable")
    ordered = key[order]
    lcp = (ordered[:-1] != ordered[1:]).argmax(axis=1)                  # [B - 1]
    neighbour = np.zeros_like(lcp)
    neighbour[1:] = lcp[:-1]
    neighbour[:-1] = np.maximum(neighbour[:-1], lcp[1:])
    cut = (lcp < min_shared_len) | (2 * lcp < neighbour)
    gid = np.concatenate([[0], np.cumsum(cut)])                         # group of sorted position
    shared = np.full(gid[-1] + 1, max_len, dtype=np.int64)
    np.minimum.at(shared, gid[1:][~cut], lcp[~cut])
    grouped = np.bincount(gid)[gid] >= 2                                # per sorted position
    if not grouped.any():
        return _empty_plan(rows, seq_lens)
    own_start = np.zeros(num_rows, dtype=np.int64)
    own_start[order[grouped]] = shared[gid[grouped]]
    # chunks: consecutive grouped positions of one group, MAX_CHUNK_ROWS at a time
    pos = np.flatnonzero(grouped)
    g = gid[pos]
    first = np.searchsorted(gid, g)                                     # group's first position
    chunk_first = np.flatnonzero((pos - first) % MAX_CHUNK_ROWS == 0)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return DecodePlan(rows, seq_lens, t(own_start), t(order[pos]),
                      t(np.append(chunk_first, pos.size)), t(shared[g[chunk_first]]))


def paged_decode(op: PagedDecodeOp, q: torch.Tensor, k_buffer: torch.Tensor,
                 v_buffer: torch.Tensor, table: torch.Tensor, plan: DecodePlan,
                 scale: float) -> torch.Tensor:
    """q ``[B, Hq, D]`` -> ``[B, Hq, D]``: row b attends to slots ``table[rows[b], :seq_lens[b]]``
    of one layer's pool buffers ``[num_slots + 1, Hkv, D]`` (float32, read in place)."""
    q = q if _rows_strided(q) else q.contiguous()   # a view into qkv is read in place
    return op(q, k_buffer, v_buffer, table, plan.rows, plan.seq_lens, plan.own_start,
              plan.members, plan.chunk_offsets, plan.chunk_lens, float(scale))


def _partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax state (m, l, acc) of queries ``[Hkv, N, D]`` over keys ``[Hkv, L, D]``."""
    if keys.shape[1] == 0:      # nothing to attend to: the state that merges as a no-op
        shape = (*q.shape[:2], 1)
        return (torch.full(shape, -torch.inf, dtype=q.dtype), torch.zeros(shape, dtype=q.dtype),
                torch.zeros_like(q))
    s = torch.matmul(q, keys.transpose(1, 2)) * scale                   # [Hkv, N, L]
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    return m, p.sum(dim=-1, keepdim=True), torch.matmul(p, values)


def paged_decode_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     table: torch.Tensor, plan: DecodePlan, scale: float) -> torch.Tensor:
    """What the kernel computes, in PyTorch (float64 inside): each chunk's prefix once, each
    row's own suffix, merged by log-sum-exp. For tests; slow."""
    bsz, hq, hd = q.shape
    hkv = k_buffer.shape[1]
    qg = q.double().reshape(bsz, hkv, hq // hkv, hd)                    # [B, Hkv, G, D]
    kb, vb = k_buffer.double(), v_buffer.double()
    state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    offsets = plan.chunk_offsets.tolist()
    for c, n in enumerate(plan.chunk_lens.tolist()):
        members = plan.members[offsets[c]:offsets[c + 1]]
        slots = table[plan.rows[members[0]], :n]
        keys, values = kb[slots].transpose(0, 1), vb[slots].transpose(0, 1)
        queries = qg[members].transpose(0, 1).reshape(hkv, -1, hd)      # [Hkv, n_m * G, D]
        m, denom, acc = (t.reshape(hkv, len(members), -1, t.shape[-1]).transpose(0, 1)
                         for t in _partial(queries, keys, values, scale))
        for i, b in enumerate(members.tolist()):
            state[b] = (m[i], denom[i], acc[i])
    out = torch.empty(bsz, hkv, hq // hkv, hd, dtype=torch.float64)
    for b in range(bsz):
        slots = table[plan.rows[b], int(plan.own_start[b]):int(plan.seq_lens[b])]
        m2, denom2, acc2 = _partial(qg[b], kb[slots].transpose(0, 1),
                                    vb[slots].transpose(0, 1), scale)
        if b in state:
            m1, denom1, acc1 = state[b]
            m = torch.maximum(m1, m2)
            w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)                # e^{-inf} = 0: empty
            denom2, acc2 = denom1 * w1 + denom2 * w2, acc1 * w1 + acc2 * w2
        out[b] = acc2 / denom2
    return out.reshape(bsz, hq, hd).to(q.dtype)
