"""Fused elementwise ops of the decoder on CPU (``fused_ops.cpp``): RMSNorm, residual add +
RMSNorm, rotary embedding in place on q and k, SiLU(gate) * up; and the sampler's one-pass
rows (next token and its logprob without a ``[B, V]`` output, ``rollout_engine.sampler``).

Built and loaded by ``build`` like every CPU kernel (compiled at first use, cached, one warning
and None when it cannot be built). The PyTorch versions in
``rollout_engine.models.layers`` stay the reference and the fallback: ``layers`` uses these only
for contiguous float32 CPU tensors, and ``ROLLOUT_ENGINE_FUSED_OPS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "fused_ops.cpp"
FUSED_ENV = "ROLLOUT_ENGINE_FUSED_OPS"

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class FusedOps:
    """The compiled library; each method checks what the C side cannot (dtype, device, shapes,
    strides) and raises ValueError rather than read out of bounds."""

    ABI = 5   # rollout_engine_fused_ops_abi() of the source these signatures describe

    def __init__(self, library_path: str) -> None:
        lib = build.open_library(library_path, "rollout_engine_fused_ops_abi", self.ABI)
        sig = {"rmsnorm": [_P, _P, _P, _I64, _I64, _I64, _F32],
               "add_rmsnorm": [_P, _P, _P, _P, _I64, _I64, _F32],
               "rope": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64],
               "rope_store": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P,
                              _I64],
               "silu_mul": [_P, _P, _I64, _I64],
               "sample_rows": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                               _P],
               "token_logprobs": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P]}
        self._fns = {}
        for name, args in sig.items():
            fn = getattr(lib, f"rollout_engine_{name}_f32")
            fn.restype, fn.argtypes = ctypes.c_int, args
            self._fns[name] = fn

    def raw(self, name: str) -> Callable[..., int]:
        """The C function behind method ``name`` (raw pointers and sizes, no checks): for
        callers that made the checks once for many calls (``models.cpu_decode``)."""
        return self._fns[name]

    @staticmethod
    def _check(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype is not torch.float32 or not t.is_cpu:
                raise ValueError("fused ops: tensors must be float32 on CPU")

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x ``[T, N]`` (rows may be strided, elements contiguous) -> new ``[T, N]``."""
        self._check(x, weight)
        n = x.shape[-1]
        if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (n,) or not weight.is_contiguous():
            raise ValueError(f"rmsnorm: x {tuple(x.shape)} / weight {tuple(weight.shape)}")
        out = torch.empty(x.shape, dtype=x.dtype)
        self._fns["rmsnorm"](x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], n,
                             x.stride(0), eps)
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """``residual += x`` in place; returns ``rmsnorm(residual)`` (all ``[T, N]``)."""
        self._check(x, residual, weight)
        n = x.shape[-1]
        if (x.dim() != 2 or x.shape != residual.shape or weight.shape != (n,)
                or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())):
            raise ValueError(f"add_rmsnorm: x {tuple(x.shape)} / residual "
                             f"{tuple(residual.shape)} / weight {tuple(weight.shape)}")
        out = torch.empty_like(x)
        self._fns["add_rmsnorm"](x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                 out.data_ptr(), x.shape[0], n, eps)
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> None:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place (heads contiguous within a
        token; tokens may be strided); cos/sin ``[T, 1, D]`` contiguous."""
        self._check(q, k, cos, sin)
        t, hq, d = q.shape
        hk = k.shape[1]
        ok = (q.dim() == 3 and k.dim() == 3 and k.shape[0] == t and k.shape[2] == d
              and d % 2 == 0 and cos.shape == (t, 1, d) and sin.shape == (t, 1, d)
              and cos.is_contiguous() and sin.is_contiguous()
              and q.stride()[1:] == (d, 1) and k.stride()[1:] == (d, 1))
        if not ok:
            raise ValueError(f"rope: q {tuple(q.shape)} {q.stride()}, k {tuple(k.shape)} "
                             f"{k.stride()}, cos {tuple(cos.shape)}")
        self._fns["rope"](q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, hq, hk,
                          d, q.stride(0), k.stride(0))

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                   cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """A decode step's ``rope`` and ``KVPool.set_kv`` in one pass over the fused qkv
        output ``[T, (Hq + 2 Hk) D]``: q rotated in place, k rotated into ``k_pool[loc]``, v
        copied into ``v_pool[loc]`` (pools ``[slots, Hk, D]``); qkv's k is left as it was."""
        self._check(qkv, cos, sin, k_pool, v_pool)
        t = qkv.shape[0]
        d = k_pool.shape[-1] if k_pool.dim() == 3 else 0
        ok = (qkv.dim() == 2 and qkv.is_contiguous() and d > 0 and d % 2 == 0
              and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
              and k_pool.shape[1] == num_kv_heads and v_pool.shape == k_pool.shape
              and k_pool.is_contiguous() and v_pool.is_contiguous()
              and cos.shape == (t, 1, d) and sin.shape == (t, 1, d)
              and cos.is_contiguous() and sin.is_contiguous()
              and loc.dtype is torch.int64 and loc.shape == (t,) and loc.is_contiguous()
              and loc.is_cpu)
        if not ok:
            raise ValueError(f"rope_store: qkv {tuple(qkv.shape)}, pools {tuple(k_pool.shape)} / "
                             f"{tuple(v_pool.shape)}, cos {tuple(cos.shape)}, loc "
                             f"{tuple(loc.shape)} {loc.dtype} disagree")
        base = qkv.data_ptr()
        q_bytes = 4 * num_heads * d
        if self._fns["rope_store"](base, base + q_bytes, base + q_bytes + 4 * num_kv_heads * d,
                                   cos.data_ptr(), sin.data_ptr(), t, num_heads, num_kv_heads,
                                   d, qkv.shape[1], loc.data_ptr(), k_pool.data_ptr(),
                                   v_pool.data_ptr(), k_pool.shape[0]):
            raise ValueError(f"rope_store: a slot in loc is outside the pool's "
                             f"{k_pool.shape[0]} slots")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` (gate then up) -> ``silu(gate) * up`` ``[T, I]``."""
        self._check(gate_up)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
            raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)}")
        n = gate_up.shape[1] // 2
        out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype)
        self._fns["silu_mul"](gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n)
        return out

    def sample_rows(self, logits: torch.Tensor, temperatures: torch.Tensor,
                    min_ps: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor,
                    penalties: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                    top_ks: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``logits`` ``[B, V]`` (rows may be strided): the token (argmax where
        ``greedy``, else inverse CDF of ``softmax(x / T)`` after min-p at ``uniforms``) and its
        ``log_softmax(x / T)``. ``temperatures`` ``[B]`` > 0 (1 for greedy). ``penalties``:
        (offsets ``[B + 1]``, ids, values) in CSR by row: the token is chosen from the row with
        those logits replaced (-inf bans; a later entry wins), the logprob from the row as is.
        ``top_ks`` ``[B]`` int64 (>= 1): a row samples only its k largest logits (ties at the
        cut: the lowest ids, as a stable descending sort keeps them); k >= V keeps the row; a
        row with penalties must keep its row."""
        self._check(logits, temperatures, min_ps)
        b, v = logits.shape if logits.dim() == 2 else (0, 0)
        ok = (logits.dim() == 2 and logits.stride(1) == 1 and v > 0
              and all(t.shape == (b,) and t.is_contiguous()
                      for t in (temperatures, min_ps, uniforms, greedy))
              and uniforms.dtype == torch.float64 and greedy.dtype == torch.uint8
              and bool((temperatures > 0).all()))
        if not ok:
            raise ValueError(f"sample_rows: logits {tuple(logits.shape)} {logits.stride()}, "
                             f"temperatures {tuple(temperatures.shape)}")
        ptrs = (None, None, None)
        if penalties is not None:
            offsets, ids, values = penalties
            n = ids.numel()
            if not (offsets.dtype == ids.dtype == torch.int64 and values.dtype == torch.float32
                    and offsets.shape == (b + 1,) and values.shape == (n,) and ids.dim() == 1
                    and all(t.is_contiguous() and t.device.type == "cpu"
                            for t in (offsets, ids, values))
                    and int(offsets[0]) == 0 and int(offsets[-1]) == n
                    and bool((offsets[1:] >= offsets[:-1]).all())
                    and (n == 0 or (int(ids.min()) >= 0 and int(ids.max()) < v))):
                raise ValueError("sample_rows: penalties must be CSR (offsets [B + 1], ids in "
                                 "[0, V), float32 values)")
            ptrs = (offsets.data_ptr(), ids.data_ptr(), values.data_ptr())
        cut = None
        if top_ks is not None:
            if not (top_ks.shape == (b,) and top_ks.dtype == torch.int64
                    and top_ks.is_contiguous() and bool((top_ks >= 1).all())):
                raise ValueError("sample_rows: top_ks must be [B] int64, each >= 1")
            cut = top_ks.data_ptr()
        tokens = torch.empty(b, dtype=torch.int64)
        logprobs = torch.empty(b, dtype=torch.float32)
        self._fns["sample_rows"](logits.data_ptr(), b, v, logits.stride(0),
                                 temperatures.data_ptr(), min_ps.data_ptr(), uniforms.data_ptr(),
                                 greedy.data_ptr(), *ptrs, cut, tokens.data_ptr(),
                                 logprobs.data_ptr())
        return tokens, logprobs


    def token_logprobs(self, logits: torch.Tensor, temperatures: torch.Tensor,
                       min_ps: torch.Tensor, greedy: torch.Tensor, tokens: torch.Tensor,
                       top_ks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B]``: the logprob ``sample_rows`` returns for row ``r`` when it draws
        ``tokens[r]`` under the same per-row arguments (no penalties), bit for bit."""
        self._check(logits, temperatures, min_ps)
        b, v = logits.shape if logits.dim() == 2 else (0, 0)
        ok = (logits.dim() == 2 and logits.stride(1) == 1 and v > 0
              and all(t.shape == (b,) and t.is_contiguous()
                      for t in (temperatures, min_ps, greedy, tokens))
              and greedy.dtype == torch.uint8 and tokens.dtype == torch.int64
              and bool((temperatures > 0).all())
              and (b == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < v))
              and (top_ks is None or (top_ks.shape == (b,) and top_ks.dtype == torch.int64
                                      and top_ks.is_contiguous()
                                      and bool((top_ks >= 1).all()))))
        if not ok:
            raise ValueError(f"token_logprobs: logits {tuple(logits.shape)}, tokens "
                             f"{tuple(tokens.shape)} {tokens.dtype}: tokens must be [B] int64 "
                             "ids in [0, V), the per-row arguments [B]")
        out = torch.empty(b, dtype=torch.float32)
        self._fns["token_logprobs"](logits.data_ptr(), b, v, logits.stride(0),
                                    temperatures.data_ptr(), min_ps.data_ptr(),
                                    greedy.data_ptr(), None if top_ks is None else
                                    top_ks.data_ptr(), tokens.data_ptr(), out.data_ptr())
        return out


@functools.cache
def load_fused_ops() -> Optional[FusedOps]:
    """The compiled ops, or None (after one warning) when they cannot be built or are turned
    off by ``ROLLOUT_ENGINE_FUSED_OPS=0``."""
    return build.load_or_warn(
        lambda: FusedOps(build.build_library(SOURCE, "rollout_engine_fused_ops")),
        "CPU fused ops", "using the PyTorch ops", FUSED_ENV)
