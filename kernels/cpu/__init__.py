"""C++ CPU kernels: each one source (``<name>.cpp``) beside the Python wrapper that loads it
(``<name>.py``).

``build`` compiles a source at first use (cached) and checks its ABI; each wrapper module
(``paged_decode``, ``fused_ops``, ``small_gemm``, ``stream_copy``, ``moe_experts``) checks what its C functions
cannot see and has a ``load_*`` that returns None, after one warning, where the kernel cannot
be built, so its caller keeps a PyTorch path. A kernel's reference is the PyTorch code it
replaces (``paged_decode_ref`` beside it; ``rollout_engine.models.layers`` for the fused ops).
Nothing here imports ``rollout_engine``.
"""
