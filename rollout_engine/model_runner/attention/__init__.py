"""Attention backends behind one contract (``base.AttentionBackend``), and the factory that
picks one by name. A backend's module is imported only when it is chosen: each may need an
optional package (triton, flashinfer)."""

from __future__ import annotations

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.base import AttentionBackend

__all__ = ["AttentionBackend", "create_attention_backend"]


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                             batch_invariant: bool = False) -> AttentionBackend:
    """The backend named ``name`` (``torch_native``, ``triton`` or ``flashinfer``) over the pools;
    ValueError for any other name. ``batch_invariant``: torch_native only (the config checks)."""
    if name == "torch_native":
        from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend(kv_pool, req_to_token, batch_invariant=batch_invariant)
    if name == "triton":
        from rollout_engine.model_runner.attention.triton_backend import TritonBackend
        return TritonBackend(kv_pool, req_to_token)
    if name == "flashinfer":
        from rollout_engine.model_runner.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(kv_pool, req_to_token)
    raise ValueError(f"unknown attention backend {name!r}")
