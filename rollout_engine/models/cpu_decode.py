"""A decode step's forward on CPU in float32 as one flat loop over the compiled kernels.

The module path (``LlamaForCausalLM.forward``) runs a decode step through ~60 ``nn.Module``
calls and ~130 kernel wrappers, each checking its tensors' dtypes, shapes and strides before
it reaches its C function. At a decode step's few rows that Python is a real share of the
step. Here the same kernels run in the same order on the same tensors, so the result is bit
for bit the module path's (tests/rollout_engine/model_runner/test_flat_decode.py checks
``torch.equal``), with the checks made once per step instead of per call (a quantized model's linears,
``models/quant_linear.py``, run their own product, as in the module path): the inputs and
buffers are the engine's own (float32, contiguous, CPU), the shapes
follow from the architecture, and every C entry point still checks the values it indexes
with (slots, the decode plan). A batch with LoRA adapters (``fb.lora``) adds their updates
after each product, as the modules do (``models/lora.py``). Rope and the KV write are one pass (``rope_store``: k rotated
straight into its pool slot, v copied there), and the norms, the attention output and the
activation each write one buffer reused for the whole step. What each of these saves a forward
is in docs/BENCHMARKS.md ("CPU choices, measured in the engine").

It applies (`CpuDecodeForward.create` returns None otherwise, and the module path runs) only
where every piece has its kernel: float32 on CPU without tensor parallelism, the fused ops and
the paged decode kernel loaded, the CPU attention backend's decode kernel in use, no q/k norm
(Qwen3). The weights and pool buffers are looked up through the model and the pool on every
call, never kept: refits, shadow swaps and sleep give parameters and buffers new storage.
``ROLLOUT_ENGINE_FLAT_DECODE=0`` keeps the module path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

import torch
from rollout_engine_kernels.cpu.fused_ops import FusedOps, load_fused_ops
from rollout_engine_kernels.cpu.small_gemm import SmallGemm, load_small_gemm, use_small_gemm

from rollout_engine.models import batch_invariant, layers, weight_packs
from rollout_engine.models.forward_batch import ForwardBatch
from rollout_engine.models.quant_linear import QUANTIZED

FLAT_DECODE_ENV = "ROLLOUT_ENGINE_FLAT_DECODE"

class CpuDecodeForward:
    """``__call__(model, fb)``: the hidden states after the final norm, ``[T, hidden]``, of a
    decode batch whose attention metadata its backend (``fb.attn_backend``) has just planned
    (``init_forward_metadata``), equal to ``model(fb.input_ids, fb.positions, fb)``. The model
    and the backend come with every call: a runner may be given another backend after it was
    built (a speculative draft shares its target's request table)."""

    def __init__(self, model: torch.nn.Module, ops: FusedOps, gemm: Optional[SmallGemm]) -> None:
        arch = model.arch
        self.hidden = arch.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.eps = arch.rms_norm_eps
        self._rmsnorm, self._add_rmsnorm = ops.raw("rmsnorm"), ops.raw("add_rmsnorm")
        self._rope_store, self._silu_mul = ops.raw("rope_store"), ops.raw("silu_mul")
        self._gemm = gemm.raw if gemm is not None and gemm.fast else None

    @classmethod
    def create(cls, model: torch.nn.Module, backend: Any) -> Optional[CpuDecodeForward]:
        """The flat loop for ``model`` with attention ``backend``, or None where it does not
        apply (see the module docstring)."""
        arch = getattr(model, "arch", None)
        if (os.environ.get(FLAT_DECODE_ENV, "1") == "0" or arch is None
                or getattr(model, "tp", None) is not None or arch.qk_norm
                or getattr(arch, "moe", None) is not None
                or getattr(backend, "decode_kernel", None) is None):
            return None
        params = list(model.parameters())   # int8: a quantized linear's weight
        if not params or any(p.dtype not in (torch.float32, torch.int8) or not p.is_cpu
                             for p in params):
            return None
        pool = backend.kv_pool
        if pool.dtype is not torch.float32 or pool.device.type != "cpu":
            return None
        ops = load_fused_ops()
        if ops is None:
            return None
        return cls(model, ops, load_small_gemm())

    def _product(self, rows: int) -> Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]:
        """``module``'s linear layer on ``x`` ``[rows, in]`` (contiguous), through the kernel
        ``layers.linear`` would pick for this row count: the small GEMM's C function directly
        where it is the choice, oneDNN on the packed copy directly where the row count needs no
        padding, else ``layers.linear`` itself."""
        packing = weight_packs.packing_ok()
        onednn = layers.small_gemm_allowed()   # float32 CPU linears go through oneDNN
        gemm = self._gemm if onednn else None
        if batch_invariant.active():   # its own products (models/batch_invariant.py)
            return lambda x, mod: (mod(x) if isinstance(mod, QUANTIZED)
                                   else batch_invariant.product(x, mod.weight, mod.bias))
        # oneDNN on the packed copy straight away where ``layers.linear`` would call it with
        # the same arguments (rows a bucket of their own: no padding), without its per-call
        # checks (~5 us a product, ~0.15 ms a step at batch 256)
        direct = onednn and packing and layers.onednn_rows(rows) == rows
        pointwise = torch.ops.mkldnn._linear_pointwise

        def product(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor:
            if isinstance(mod, QUANTIZED):   # its own product (models/quant_linear.py)
                return mod(x)
            weight, bias = mod.weight, mod.bias
            n = weight.shape[0]
            if gemm is None or not use_small_gemm(rows, n, packing) or weight.stride(1) != 1:
                packed = weight_packs.packed(weight) if direct else None
                if packed is not None:
                    return pointwise(x, packed, bias, "none", [], "")
                return layers.linear(x, weight, bias)
            out = torch.empty(rows, n, dtype=torch.float32)
            k = x.shape[1]
            gemm(x.data_ptr(), rows, k, k, weight.data_ptr(), n, weight.stride(0),
                 None if bias is None else bias.data_ptr(), out.data_ptr(), n)
            return out

        return product

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module,
                  h: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place; its RMSNorm by ``norm``'s weight written into ``h``."""
        self._add_rmsnorm(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(),
                          h.data_ptr(), x.shape[0], self.hidden, self.eps)
        return h

    def __call__(self, model: torch.nn.Module, fb: ForwardBatch) -> torch.Tensor:
        backend = fb.attn_backend
        pool = backend.kv_pool
        lora = fb.lora   # LoraBatch: adapters' updates after each product, as the modules add
        x = model.embed_tokens(fb.input_ids)
        cos, sin = model.rotary.cos_sin(fb.positions, x.dtype)
        t, hidden, eps = x.shape[0], self.hidden, self.eps
        if not (x.dtype is torch.float32 and x.is_contiguous() and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == (t, 1, self.head_dim)):
            raise ValueError(f"flat decode: embedding {tuple(x.shape)} / rotary "
                             f"{tuple(cos.shape)} are not what the kernels take")
        product = self._product(t)
        attend = backend.decode_kernel.prepared(
            backend.req_to_token.table, fb.attn_metadata.plan, t, self.num_heads,
            self.num_kv_heads, self.head_dim)
        q_size, kv_size, loc = self.q_size, self.kv_size, fb.out_cache_loc
        if not (loc.dtype is torch.int64 and loc.is_cpu and loc.is_contiguous()
                and loc.shape == (t,)):
            raise ValueError(f"flat decode: out_cache_loc {tuple(loc.shape)} {loc.dtype} is "
                             f"not {t} contiguous int64 slots")
        qkv_width = q_size + 2 * kv_size
        pool_shape = (self.num_kv_heads, self.head_dim)
        residual = x
        # the norms' outputs, the attention output and the activation: one buffer each for
        # the step, each read by the next product before the next layer writes it again (its
        # lines stay in cache instead of a fresh allocation a layer)
        h = torch.empty_like(x)
        o = torch.empty(t, q_size, dtype=torch.float32)
        inter = model.layers[0].mlp.gate_up_proj.weight.shape[0] // 2
        act = torch.empty(t, inter, dtype=torch.float32)
        self._rmsnorm(x.data_ptr(), model.layers[0].input_layernorm.weight.data_ptr(),
                      h.data_ptr(), t, hidden, hidden, eps)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            if i:
                self._add_norm(x, residual, layer.input_layernorm, h)
            qkv = product(h, attn.qkv_proj)
            if lora is not None:
                lora.apply(i, "qkv_proj", h, qkv)
            base = qkv.data_ptr()
            kbuf, vbuf = pool.k_buffers[i], pool.v_buffers[i]
            if not (kbuf.shape[1:] == pool_shape and vbuf.shape == kbuf.shape
                    and kbuf.is_contiguous() and vbuf.is_contiguous()):
                raise ValueError(f"flat decode: pool buffers {tuple(kbuf.shape)} / "
                                 f"{tuple(vbuf.shape)} of layer {i} are not [slots, "
                                 f"{self.num_kv_heads}, {self.head_dim}] contiguous")
            # q rotated in place, k rotated into the pool at loc, v copied there
            if self._rope_store(base, base + 4 * q_size, base + 4 * (q_size + kv_size),
                                cos.data_ptr(), sin.data_ptr(), t, self.num_heads,
                                self.num_kv_heads, self.head_dim, qkv_width, loc.data_ptr(),
                                kbuf.data_ptr(), vbuf.data_ptr(), kbuf.shape[0]):
                raise ValueError(f"flat decode: a slot in out_cache_loc is outside the pool's "
                                 f"{kbuf.shape[0]} slots")
            attend(base, qkv_width, kbuf, vbuf, attn.scaling, o.data_ptr())
            x = product(o, attn.o_proj)
            if lora is not None:
                lora.apply(i, "o_proj", o, x)
            self._add_norm(x, residual, layer.post_attention_layernorm, h)
            gate_up = product(h, layer.mlp.gate_up_proj)
            if lora is not None:
                lora.apply(i, "gate_up_proj", h, gate_up)
            if gate_up.shape[1] != 2 * inter:
                raise ValueError(f"flat decode: layer {i}'s gate_up gives {gate_up.shape[1]} "
                                 f"columns, not {2 * inter}")
            self._silu_mul(gate_up.data_ptr(), act.data_ptr(), t, inter)
            x = product(act, layer.mlp.down_proj)
            if lora is not None:
                lora.apply(i, "down_proj", act, x)
        return self._add_norm(x, residual, model.norm, torch.empty_like(x))
