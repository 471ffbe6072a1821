"""Triton kernels for the rollout engine.

One kernel per module; each module ships a launcher (e.g. ``decode_attention``) and a
pure-PyTorch reference with the same signature (``decode_attention_ref``) that the tests
compare against. Importing a kernel module needs ``triton``; on a machine without CUDA set
``TRITON_INTERPRET=1`` before the first ``import triton`` to run kernels on CPU tensors.

KV layout shared by the attention kernels:

    k_buffer, v_buffer : [num_slots, num_kv_heads, head_dim]   (one slot per token)
    req_to_token       : [max_num_reqs, max_context_len] int32  (position -> slot)
"""
