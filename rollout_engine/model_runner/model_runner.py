"""ModelRunner: owns the model, the KV pool and the attention backend; ForwardBatch -> logits.

With tensor parallelism (``tp``: passed, or installed for rank 0, rollout_engine/parallel) it
holds one rank's shard of the weights and a KV pool of that rank's KV heads, and rank 0 sends
each forward's inputs to the other ranks before running its own part.

With ``enable_return_routed_experts`` on a mixture-of-experts model, every forward records the
experts of each token it computes into ``routing`` at the token's KV slot
(memory/routing_store.py); on rank 0 only, as only rank 0 schedules.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from rollout_engine_kernels.cpu.fused_ops import load_fused_ops

from rollout_engine.config import EngineConfig
from rollout_engine.memory import huge_pages
from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool, row_width
from rollout_engine.memory.routing_store import create_routing_store
from rollout_engine.model_runner.attention import create_attention_backend
from rollout_engine.model_runner.attention.torch_native import KernelDecodeMeta
from rollout_engine.model_runner.cuda_graph import create_decode_graphs
from rollout_engine.models import batch_invariant, weight_writes
from rollout_engine.models.cpu_decode import CpuDecodeForward
from rollout_engine.models.forward_batch import ForwardBatch
from rollout_engine.models.layers import compute_inv_freq
from rollout_engine.models.llama import ModelArch
from rollout_engine.models.moe import routing_bytes_per_token
from rollout_engine.models.quant_linear import keep_scales_float32
from rollout_engine.models.registry import build_model
from rollout_engine.parallel.context import TPContext, current_tp
from rollout_engine.quantization.checkpoint import resolve_method
from rollout_engine.weights.loader import iter_safetensors, load_weights, read_hf_config

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_TOKENS = 32768


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: Optional[TPContext] = None) -> None:
        self.config = config
        self.tp = tp if tp is not None else current_tp()
        self.device = config.resolved_device() if self.tp is None else self.tp.group.device
        self.dtype = config.resolved_dtype()
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif self.device.type == "cpu" and self.tp is not None:   # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.tp.size))
        self.hf_config = read_hf_config(config.model_path)
        self.arch = ModelArch.from_hf_config(self.hf_config)
        # the checkpoint's quantization or --quantization's (rollout_engine/quantization)
        self.quantization = resolve_method(config.quantization, self.hf_config)
        self.context_len = config.context_length or self.arch.max_position_embeddings
        with torch.device("meta"):
            model = build_model(self.arch, self.tp, self.quantization)
        model = model.to_empty(device=self.device).to(self.dtype)
        keep_scales_float32(model)
        with weight_writes.writing():   # memory of their own (memory/huge_pages.py)
            for p in model.parameters():
                if p.numel() * p.element_size() >= huge_pages.HUGE_PAGE:
                    p.data = huge_pages.empty(p.shape, p.dtype, p.device)
        # meta -> empty left the RoPE buffer uninitialised; it stays float32 whatever the dtype
        model.rotary.inv_freq = compute_inv_freq(
            self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling).to(self.device)
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        load_weights(self.model, iter_safetensors(config.model_path), require_all=True)
        # the routing record (R3): the scheduling rank only, and only on a model with experts
        records = (config.enable_return_routed_experts and self.arch.moe is not None
                   and (self.tp is None or self.tp.leader is not None))
        self.routing_bytes_per_token = (routing_bytes_per_token(self.arch.moe)
                                        if records and self.arch.moe is not None else 0)
        num_kv_heads = self.arch.num_kv_heads
        if self.tp is not None:   # this rank's KV heads
            num_kv_heads = self.tp.kv_heads(self.arch.num_heads, self.arch.num_kv_heads)[1]
        self.max_total_num_tokens = self._kv_capacity(num_kv_heads)
        if self.tp is not None:   # every rank's pool holds as many slots
            self.max_total_num_tokens = self.tp.group.min_int(self.max_total_num_tokens)
        self.max_running_requests = config.max_running_requests or 512
        self.kv_pool = KVPool(self.max_total_num_tokens, self.arch.num_layers,
                              num_kv_heads, self.arch.head_dim, self.dtype, self.device)
        self.routing = create_routing_store(records, self.arch.moe, self.arch.num_layers,
                                            self.kv_pool.num_slots + 1, self.device)
        self.req_to_token = ReqToTokenPool(self.max_running_requests + 8,
                                           row_width(self.context_len, config.page_size),
                                           self.device)
        # a token's result independent of its batch (models/batch_invariant.py)
        self.batch_invariant = config.enable_deterministic_inference
        if self.batch_invariant:
            batch_invariant.kernel()   # RuntimeError here, not at the first forward
            if load_fused_ops() is None:
                raise RuntimeError("enable_deterministic_inference needs the CPU fused ops "
                                   "(norms, RoPE, activation per row), which could not be "
                                   "built here")
        self.attn_backend = create_attention_backend(config.resolved_attention_backend(),
                                                     self.kv_pool, self.req_to_token,
                                                     self.batch_invariant)
        self.graphs = create_decode_graphs(
            self.model, self.kv_pool, self.req_to_token, device=self.device,
            attention_backend=config.resolved_attention_backend(),
            # not captured with tp, nor for MoE layers (grouping by expert reads the counts
            # on the host)
            disabled=config.disable_cuda_graph or self.tp is not None or self.arch.moe is not None,
            max_bs=min(config.cuda_graph_max_bs, self.max_running_requests))
        # CPU float32 decode steps through one flat loop over the kernels (None elsewhere)
        self.flat_decode = CpuDecodeForward.create(self.model, self.attn_backend)
        if self.tp is not None and self.tp.leader is not None:
            # rank 0: every forward first sends its inputs to the other ranks (TP=1 keeps the
            # plain method: no per-step cost)
            self.forward = self._forward_leader  # type: ignore[method-assign]
            self.tp.leader.model = self.model   # weight reads join the slices by its shards

    def _kv_capacity(self, num_kv_heads: int) -> int:
        ps = self.config.page_size
        if self.config.max_total_tokens is not None:
            tokens = self.config.max_total_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_token = (2 * self.arch.num_layers * num_kv_heads * self.arch.head_dim
                         * torch.empty((), dtype=self.dtype).element_size()
                         + self.routing_bytes_per_token)
            tokens = int(free * self.config.mem_fraction_static) // per_token
        else:
            tokens = _CPU_DEFAULT_KV_TOKENS
        return max(ps, tokens // ps * ps)

    def weight_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits ``[len(fb.logits_indices), vocab]`` in float32; the routing of every token
        recorded at its slot when ``routing`` records."""
        fb.routing_out = self.routing.out_buffer(int(fb.input_ids.shape[0]))
        # the captured graphs write no routing record and apply no LoRA adapter: such a
        # forward runs eagerly (the flat decode loop applies adapters)
        plain = fb.routing_out is None and fb.lora is None
        if plain and self.graphs.can_run(fb):
            return self.graphs.replay(fb)
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        with batch_invariant.forwards(self.batch_invariant):
            if (self.flat_decode is not None
                    and isinstance(fb.attn_metadata, KernelDecodeMeta)):
                hidden = self.flat_decode(self.model, fb)   # the same kernels, no module calls
            else:
                hidden = self.model(fb.input_ids, fb.positions, fb)
            logits = self.model.compute_logits(hidden[fb.logits_indices])
        if fb.routing_out is not None:
            self.routing.record(fb)
        return logits

    def _forward_leader(self, fb: ForwardBatch) -> torch.Tensor:
        assert self.tp is not None
        leader = self.tp.leader
        leader.send_forward(fb, self.req_to_token.table)
        try:
            return ModelRunner.forward(self, fb)
        except RuntimeError as e:   # a collective failed: name the rank that is gone
            leader.raise_if_rank_died(e)   # raises TPRankDied
            raise
