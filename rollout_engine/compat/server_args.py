"""SGLang's server flags, and what rollout_engine does with each: ONE table.

``python -m sglang.launch_server --flags`` and ``sgl.Engine(**server_args)`` take the fields of
SGLang's ``ServerArgs``. ``python -m rollout_engine.launch_server`` and ``Engine(**kwargs)``
take every one of them too (as well as ``EngineConfig``'s own), and treat each as this table says:

    ours           the ``EngineConfig`` field of the same name; SGLang's spellings of a value are
                   converted (``--dtype half``, ``--chunked-prefill-size -1``, an attention
                   backend we do not have); None (SGLang's "choose for me") means our default
    special        converted below: ``base_gpu_id`` (-> ``device``), ``load_format`` (our loader
                   reads safetensors; ``dummy`` loads the real weights, which a refit then
                   overwrites), ``stream_output`` (0.5.9's name of incremental streaming)
    ignore:WHY     accepted with any value and without effect: logging, kernel and launch
                   knobs that do not change what is generated (WHY: see ``IGNORED``)
    default[:WHY]  accepted at SGLang's default only (e.g. ``--tp-size 1``); any other value is
                   an ``UnsupportedFlagError`` that names the flag (the launcher exits 2)

The rows are every flag of sglang 0.5.9 and 0.5.23 (``SGLANG_VERSIONS``; for a flag in both,
0.5.23's kind and default), read from their ``ServerArgs.add_cli_args`` parsers. ``kind`` is how
the command line parses it: ``switch`` (store_true), ``bool`` (``--x`` / ``--no-x``), ``int``,
``size`` (an int with SGLang's ``32k`` / ``1Mi`` suffixes), ``float``, ``str``, ``json``, with
``+``, ``*`` or ``?`` for a list. A name on no row is unknown to SGLang as well: the launcher's
argparse and ``EngineConfig.from_kwargs`` refuse it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SGLANG_FLAGS", "SGLANG_VERSIONS", "SglangFlag", "UnsupportedFlagError",
           "add_sglang_flags", "parse_size", "server_args_view", "to_engine_kwargs"]

logger = logging.getLogger(__name__)

SGLANG_VERSIONS = ("0.5.9", "0.5.23")

# why a flag is accepted only at its default (the tag after "default:")
UNSUPPORTED = {
    "1gpu": "rollout_engine serves one model replica on one device: tensor, pipeline, data, "
            "expert and context parallelism are not implemented; run one server per GPU (with "
            "sglang-router in front)",
    "pd": "prefill/decode disaggregation is not implemented",
    "lora": "LoRA adapters are not implemented",
    "quant": "quantized weights and KV caches are not implemented (the model runs in --dtype)",
    "spec": "speculative decoding is not implemented",
    "embed": "only generative models are served",
    "offload": "offloading weights to the CPU is not implemented",
    "": "rollout_engine does not implement this SGLang option",
}
# why a flag is accepted and ignored (the tag after "ignore:")
IGNORED = {
    "log": "logging / metrics knob of SGLang's (rollout_engine always serves /metrics)",
    "launch": "launch detail of SGLang's multi-process server (one process and device here)",
    "perf": "kernel or performance choice; what is generated does not depend on it",
    "tokenizer": "the tokenizer is always loaded; outputs carry text as well as token ids",
    "lora": "LoRA sizing, inert without LoRA",
    "draft": "no draft model",
    "deprecated": "deprecated by SGLang, without effect there too",
}
# SGLang's attention backends (both versions); one we lack becomes our default choice
SGLANG_ATTENTION_BACKENDS = frozenset(
    "triton torch_native flex_attention dsa nsa qsa dsv4 compressed cutlass_mla fa3 fa4 "
    "flashinfer llada2_cfg_flashinfer flashmla trtllm_mla cutedsl_mla tokenspeed_mla trtllm_mha "
    "hpc_ops dual_chunk_flash_attn minicpm_flashattn minicpm_flashinfer aiter wave intel_amx "
    "ascend intel_xpu".split())
OUR_ATTENTION_BACKENDS = frozenset({"torch_native", "triton", "flashinfer"})


@dataclass(frozen=True)
class SglangFlag:
    """One row: a ``ServerArgs`` field, how its flag parses, SGLang's default, our treatment."""

    name: str
    kind: str
    default: Any
    treatment: str        # ours | special | ignore | default
    why: str = ""         # key of UNSUPPORTED / IGNORED

    @property
    def option_strings(self) -> tuple[str, ...]:
        return ("--" + self.name.replace("_", "-"), *ALIASES.get(self.name, ()))

    @property
    def option(self) -> str:
        return self.option_strings[0]


class UnsupportedFlagError(ValueError):
    """An SGLang flag given a value rollout_engine cannot honour; the message names the flag."""

    def __init__(self, flag: SglangFlag, value: Any, why: str) -> None:
        super().__init__(f"{flag.option} {value!r}: {why}")
        self.flag = flag


def _refuse(flag: SglangFlag, value: Any) -> UnsupportedFlagError:
    return UnsupportedFlagError(
        flag, value, f"{UNSUPPORTED[flag.why]} (only SGLang's default {flag.default!r} is "
                     "accepted; see rollout_engine/compat/server_args.py)")


# -- SGLang keyword values -> EngineConfig keywords ------------------------------------------------
Convert = Callable[[SglangFlag, Any, Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def _same_name(flag: SglangFlag, value: Any, given: Mapping[str, Any],
               ours: Mapping[str, Any]) -> dict[str, Any]:
    return {flag.name: value}


def _dtype(flag: SglangFlag, value: Any, given: Mapping[str, Any],
           ours: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtype": {"half": "float16", "float": "float32"}.get(value, value)}


def _attention_backend(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                       ours: Mapping[str, Any]) -> dict[str, Any]:
    if value in SGLANG_ATTENTION_BACKENDS and value not in OUR_ATTENTION_BACKENDS:
        logger.warning("%s %s: not one of ours (%s); using the default choice for the device",
                       flag.option, value, ", ".join(sorted(OUR_ATTENTION_BACKENDS)))
        return {}
    return {"attention_backend": value}


def _chunked_prefill_size(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                          ours: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        # SGLang's -1: no chunking; the closest we have is one chunk per prefill budget
        return {"chunked_prefill_size": given.get("max_prefill_tokens")
                or ours["max_prefill_tokens"]}
    return {"chunked_prefill_size": value}


def _base_gpu_id(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                 ours: Mapping[str, Any]) -> dict[str, Any]:
    if value == 0:
        return {}
    device = given.get("device") or "auto"
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 \
            or device not in ("auto", "cuda"):
        raise UnsupportedFlagError(flag, value, f"a GPU index is used with --device cuda "
                                                f"(or auto), not {device!r}")
    return {"device": f"cuda:{value}"}


def _load_format(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                 ours: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("auto", "safetensors"):
        return {}
    if value == "dummy":
        logger.info("--load-format dummy: loading the real weights (a refit overwrites them)")
        return {}
    raise UnsupportedFlagError(flag, value, "the loader reads safetensors (auto, safetensors; "
                                            "dummy loads them too)")


def _stream_output(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                   ours: Mapping[str, Any]) -> dict[str, Any]:
    return {"incremental_streaming_output": bool(value)}


_CONVERT: dict[str, Convert] = {
    "dtype": _dtype, "attention_backend": _attention_backend,
    "chunked_prefill_size": _chunked_prefill_size, "base_gpu_id": _base_gpu_id,
    "load_format": _load_format, "stream_output": _stream_output,
}


def to_engine_kwargs(given: Mapping[str, Any], ours: Mapping[str, Any]
                     ) -> tuple[dict[str, Any], list[str]]:
    """``given`` (SGLang ``ServerArgs`` names and ``EngineConfig``'s own) -> (``EngineConfig``
    keywords, names neither knows). ``ours`` maps each EngineConfig field to its default.
    Raises ``UnsupportedFlagError`` for a value we cannot honour. Idempotent on its output."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    specials = []
    for name, value in given.items():
        flag = SGLANG_FLAGS.get(name)
        if flag is None:
            if name in ours:
                out[name] = value
            else:
                unknown.append(name)
        elif flag.treatment == "ours":
            if value is None and ours[name] is not None:
                continue      # SGLang's "choose for me": our default chooses
            out.update(_CONVERT.get(name, _same_name)(flag, value, given, ours))
        elif flag.treatment == "special":
            specials.append((flag, value))
        elif flag.treatment == "ignore":
            if not _is_default(flag, value):
                logger.info("%s %r ignored: %s", flag.option, value, IGNORED[flag.why])
        elif not _is_default(flag, value):
            raise _refuse(flag, value)
    for flag, value in specials:     # after the named fields they may refine (device)
        out.update(_CONVERT[flag.name](flag, value, given, ours))
    return out, unknown


def _is_default(flag: SglangFlag, value: Any) -> bool:
    """``value`` means what SGLang's default means: equal numbers (1 == 1.0), a list for a
    tuple, and for a switch False and None alike."""
    default = flag.default
    if flag.kind in ("switch", "bool") and value in (None, False, True) \
            and default in (None, False, True):
        return bool(value) == bool(default)
    if _is_number(value) and _is_number(default):
        return bool(value == default)
    if isinstance(value, tuple):
        value = list(value)
    return type(value) is type(default) and value == default


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def server_args_view(config: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``ServerArgs`` as this engine runs, for ``get_server_info``: a field we map
    has our value (``config``: ``EngineConfig.to_dict()``), a field accepted only at its default
    has that default; ignored fields are left out (what they were given is not kept)."""
    view: dict[str, Any] = {}
    for name, flag in SGLANG_FLAGS.items():
        if flag.treatment == "ours":
            view[name] = config[name]
        elif flag.treatment == "default":
            view[name] = copy.deepcopy(flag.default)
    device = str(config["device"])
    view["base_gpu_id"] = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    view["load_format"] = "auto"
    view["stream_output"] = config["incremental_streaming_output"]
    return view


# -- the command line ----------------------------------------------------------------------------
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_size(text: str) -> int:
    """SGLang's ``human_readable_int``: ``4096``, ``32k`` (SI, decimals allowed), ``1Mi``."""
    text = text.strip()
    m = _SIZE.fullmatch(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer or size: {text!r}") from None
    number, suffix = m.groups()
    if suffix in _IEC:
        if "." in number:
            raise argparse.ArgumentTypeError(f"IEC suffixes take whole numbers: {text!r}")
        return int(number) * _IEC[suffix]
    return int(float(number) * _SI[suffix])


_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "size": parse_size, "float": float,
                                           "str": str, "json": json.loads}


def add_sglang_flags(parser: argparse.ArgumentParser, skip: set[str]) -> None:
    """Add every row's flag whose name is not in ``skip`` (our own flags, already added). A flag
    absent from the command line is absent from the namespace (``argparse.SUPPRESS``)."""
    group = parser.add_argument_group(
        "SGLang flags", "every flag of python -m sglang.launch_server (hidden here); see "
                        "rollout_engine/compat/server_args.py for what each does")
    for name, flag in SGLANG_FLAGS.items():
        if name in skip:
            continue
        common = {"dest": name, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if flag.kind == "switch":
            group.add_argument(*flag.option_strings, action="store_true", **common)
        elif flag.kind == "bool":
            group.add_argument(*flag.option_strings, action=argparse.BooleanOptionalAction,
                               **common)
        else:
            base, nargs = flag.kind.rstrip("+*?"), flag.kind[len(flag.kind.rstrip("+*?")):]
            group.add_argument(*flag.option_strings, type=_TYPES[base], nargs=nargs or None,
                               **common)


# -- the table -----------------------------------------------------------------------------------
ALIASES: dict[str, tuple[str, ...]] = {
    'attn_cp_size': ('--attention-context-parallel-size',),
    'attn_dp_size': ('--attention-data-parallel-size',),
    'cuda_graph_prefill_max_context': ('--context-bucket',),
    'dcp_size': ('--decode-context-parallel-size',),
    'dist_init_addr': ('--nccl-init-addr',),
    'dp_size': ('--data-parallel-size',),
    'enable_hierarchical_cache': ('--enable-hicache',),
    'ep_join_mode': ('--elastic-ep-join-mode',),
    'ep_join_rank_offset': ('--elastic-ep-join-rank-offset',),
    'ep_size': ('--expert-parallel-size', '--ep'),
    'fp4_gemm_runner_backend': ('--fp4-gemm-backend',),
    'fp8_gemm_runner_backend': ('--fp8-gemm-backend',),
    'model_path': ('--model',),
    'moe_dp_size': ('--moe-data-parallel-size',),
    'pp_size': ('--pipeline-parallel-size',),
    'smg_http_sidecar_port': ('--grpc-http-sidecar-port',),
    'speculative_draft_model_path': ('--speculative-draft-model',),
    'tp_size': ('--tensor-parallel-size',),
}

# name                                       kind    SGLang default       treatment
_TABLE = """
abort_on_priority_when_disabled              switch  False                default
admin_api_key                                str     None                 ours
allow_auto_truncate                          switch  False                default
allowed_media_domains                        str+    []                   default
api_key                                      str     None                 ours
asr_max_buffer_seconds                       int     60                   default
asr_max_concurrent_sessions                  int     32                   default
attention_backend                            str     None                 ours
attn_cp_size                                 int     1                    default:1gpu
attn_dp_size                                 int     1                    default:1gpu
base_gpu_id                                  int     0                    special
batch_notify_size                            int     16                   default
bf16_gemm_backend                            str     'auto'               ignore:perf
boundary_reduction                           str     'auto'               default
bucket_e2e_request_latency                   float+  None                 ignore:log
bucket_inter_token_latency                   float+  None                 ignore:log
bucket_time_to_first_token                   float+  None                 ignore:log
c128_page_size                               int     16                   default
chat_template                                str     None                 default
checkpoint_engine_wait_weights_before_ready  switch  False                default
chunked_prefill_size                         int     None                 ours
collect_tokens_histogram                     switch  False                ignore:log
completion_template                          str     None                 default
config                                       str     None                 default
constrained_json_disable_any_whitespace      switch  False                default
constrained_json_max_whitespace_cnt          int     None                 default
constrained_json_whitespace_pattern          str     None                 default
context_length                               size    None                 ours
cp_strategy                                  str     None                 default
cpu_offload_gb                               int     0                    default:offload
crash_dump_folder                            str     None                 ignore:log
cuda_graph_backend_decode                    str     None                 ignore:perf
cuda_graph_backend_prefill                   str     None                 ignore:perf
cuda_graph_bs                                int+    None                 ignore:perf
cuda_graph_bs_decode                         int+    None                 ignore:perf
cuda_graph_bs_prefill                        int+    None                 ignore:perf
cuda_graph_config                            str     None                 ignore:perf
cuda_graph_max_bs                            int     None                 ours
cuda_graph_max_bs_decode                     int     None                 ignore:perf
cuda_graph_max_bs_prefill                    int     None                 ignore:perf
cuda_graph_max_seq_len_prefill               int     None                 ignore:perf
cuda_graph_prefill_max_context               size    None                 ignore:perf
custom_sigquit_handler                       str     None                 ignore:launch
custom_weight_loader                         str*    None                 default
dcp_comm_backend                             str     None                 default
dcp_replicate_q_proj                         bool    None                 default
dcp_size                                     int     1                    default:1gpu
debug_cuda_graph                             switch  False                ignore:perf
debug_tensor_dump_inject                     str     False                ignore:log
debug_tensor_dump_input_file                 str     None                 default
debug_tensor_dump_layers                     int+    None                 default
debug_tensor_dump_output_folder              str     None                 default
decode_attention_backend                     str     None                 ignore:perf
decode_log_interval                          int     40                   ignore:log
decoupled_spec_bind_endpoint                 str     None                 default
decoupled_spec_connect_endpoints             json    None                 default
decoupled_spec_rank                          int     None                 default
decoupled_spec_role                          str     'null'               default
decrypted_config_file                        str     None                 default
decrypted_draft_config_file                  str     None                 default
deepep_config                                str     None                 default
deepep_dispatcher_output_dtype               str     'auto'               default
deepep_mode                                  str     'auto'               default
deepep_v2_mode                               str     'direct'             default
default_chat_template_kwargs                 json    None                 default
default_priority_value                       int     None                 default
delete_ckpt_after_loading                    switch  False                default
detokenizer_worker_num                       int     1                    ignore:launch
device                                       str     None                 ours
disable_aiter_allreduce_fusion_in_decode     switch  False                default
disable_aiter_allreduce_fusion_in_prefill    switch  False                default
disable_attn_tp_gather                       switch  False                default
disable_chunked_prefix_cache                 switch  False                ignore:perf
disable_cuda_graph                           switch  False                ours
disable_cuda_graph_padding                   switch  False                ignore:perf
disable_custom_all_reduce                    switch  False                ignore:perf
disable_decode_cuda_graph                    switch  False                ignore:perf
disable_fast_image_processor                 switch  False                default
disable_flashinfer_autotune                  switch  False                ignore:perf
disable_flashinfer_cutlass_moe_fp4_allgather switch  False                default
disable_hicache_numa_detect                  switch  False                default
disable_hybrid_swa_memory                    switch  False                default
disable_outlines_disk_cache                  switch  False                ignore:perf
disable_overlap_schedule                     switch  False                ignore:perf
disable_prefill_cuda_graph                   switch  False                ignore:perf
disable_priority_preemption                  switch  False                default
disable_radix_cache                          switch  False                ours
disable_shared_experts_fusion                switch  False                default
disable_tokenizer_batch_decode               switch  False                ignore:perf
disaggregation_bootstrap_port                int     8998                 default
disaggregation_decode_allocation_policy      str     'early'              default
disaggregation_decode_dp                     int     None                 default
disaggregation_decode_enable_offload_kvcache switch  False                default
disaggregation_decode_enable_radix_cache     switch  False                default
disaggregation_decode_extra_slots            int     None                 default
disaggregation_decode_host_receive_threshold float   1.0                  default
disaggregation_decode_polling_interval       int     1                    default
disaggregation_decode_retraction_backup      str     None                 default
disaggregation_decode_tp                     int     None                 default
disaggregation_enable_kv_checksum            switch  False                default
disaggregation_ib_device                     str     None                 default
disaggregation_mode                          str     'null'               default:pd
disaggregation_prefill_pp                    int     1                    default
disaggregation_transfer_backend              str     'mooncake'           default
dist_init_addr                               str     None                 ignore:launch
dist_timeout                                 int     None                 ignore:launch
dllm_algorithm                               str     None                 default
dllm_algorithm_config                        str     None                 default
dllm_fdfo                                    bool    True                 default
download_dir                                 str     None                 ignore:launch
dp_size                                      int     1                    default:1gpu
ds_channel_config_path                       str     None                 default
ds_heavy_channel_num                         int     32                   default
ds_heavy_channel_type                        str     'qk'                 default
ds_heavy_token_num                           int     256                  default
ds_sparse_decode_threshold                   int     4096                 default
dsa_decode_backend                           str     None                 default
dsa_paged_mqa_logits_backend                 str     'auto'               default
dsa_prefill_backend                          str     None                 default
dsa_topk_backend                             str     'sgl-kernel'         default
dsa_triton_union                             int     0                    default
dsv4_attn_backend                            str     'auto'               default
dsv4_prefill_backend                         str     'auto'               default
dtype                                        str     'auto'               ours
dwdp_size                                    int     1                    default
dynamic_batch_tokenizer_batch_size           int     32                   ignore:perf
dynamic_batch_tokenizer_batch_timeout        float   0.002                ignore:perf
elastic_ep_backend                           str     None                 default
elastic_ep_initial_size                      int     None                 default
elastic_ep_scale_timeout                     float   600                  default
enable_adaptive_dispatch_to_encoder          switch  False                default
enable_aiter_allreduce_fusion                switch  False                default
enable_amd_monokernel                        switch  False                default
enable_attn_tp_input_scattered               switch  False                default
enable_broadcast_mm_inputs_process           switch  False                default
enable_cache_report                          switch  False                ignore:log
enable_cp_decode_attn_tp                     switch  False                default
enable_cudagraph_gc                          switch  False                ignore:perf
enable_custom_logit_processor                switch  False                default
enable_decoder_swa_bounded_replay            bool    None                 default
enable_deepseek_v4_fp4_indexer               switch  False                default
enable_dense_mlp_attn_tp                     switch  False                default
enable_deterministic_inference               switch  False                default
enable_double_sparsity                       switch  False                default
enable_dp_attention                          switch  False                default:1gpu
enable_dp_attention_local_control_broadcast  switch  False                default
enable_dp_lm_head                            switch  False                default
enable_draft_weights_cpu_backup              switch  False                ignore:draft
enable_dsa_cache_layer_split                 switch  False                default
enable_dsa_fused_indexer                     bool    None                 default
enable_dynamic_batch_tokenizer               switch  False                ignore:perf
enable_dynamic_chunking                      switch  False                ignore:perf
enable_elastic_expert_backup                 switch  False                default
enable_encoder_swa_bounded_replay            switch  False                default
enable_eplb                                  switch  False                default
enable_expert_distribution_metrics           switch  False                ignore:log
enable_flashinfer_allreduce_fusion           switch  False                default
enable_flexkv                                switch  False                default
enable_forward_pass_metrics                  switch  False                ignore:log
enable_fp32_lm_head                          switch  False                default
enable_fused_moe_sum_all_reduce              switch  False                default
enable_fused_qk_norm_rope                    bool    None                 ignore:perf
enable_hierarchical_cache                    switch  False                default
enable_hisparse                              switch  False                default
enable_http2                                 switch  False                default
enable_http_worker_reuseport                 switch  False                ignore:launch
enable_int8_mamba_checkpoint                 switch  False                default
enable_kv_cache_sharding                     switch  False                default
enable_layernorm_sp                          switch  False                default
enable_layerwise_nvtx_marker                 switch  False                ignore:log
enable_lean_attention                        switch  None                 default
enable_linear_replayssm                      switch  False                default
enable_linear_replayssm_spec                 switch  False                default
enable_linker_mla_dedup                      switch  False                default
enable_lmcache                               switch  False                default
enable_lora                                  switch  None                 default:lora
enable_lora_overlap_loading                  switch  None                 default
enable_mamba_cache_stochastic_rounding       switch  False                default
enable_megamoe_for_layernorm_sp              switch  False                default
enable_memory_saver                          switch  False                ours
enable_metrics                               switch  False                ignore:log
enable_metrics_for_all_schedulers            switch  False                ignore:log
enable_mfu_metrics                           switch  False                ignore:log
enable_mis                                   switch  False                default
enable_mixed_chunk                           switch  False                ignore:perf
enable_mm_global_cache                       switch  False                default
enable_mscclpp                               switch  False                ignore:perf
enable_multi_layer_eagle                     switch  False                default
enable_multimodal                            switch  None                 default
enable_nan_detection                         switch  False                ignore:perf
enable_nccl_nvls                             switch  False                ignore:perf
enable_nsa_prefill_context_parallel          switch  False                default
enable_nvidia_megakernel                     switch  False                default
enable_p2p_check                             switch  False                ignore:perf
enable_page_major_kv_layout                  switch  False                default
enable_paged_experts                         switch  False                default
enable_pd_role_switch                        switch  False                default
enable_pdmux                                 switch  False                default
enable_piecewise_cuda_graph                  switch  False                ignore:perf
enable_precise_embedding_interpolation       switch  False                default
enable_prefill_cp                            switch  False                default
enable_prefill_delayer                       switch  False                default
enable_prefix_mm_cache                       switch  False                default
enable_priority_scheduling                   switch  False                default
enable_profile_cuda_graph                    switch  False                ignore:perf
enable_quant_communications                  switch  False                default
enable_request_time_stats_logging            switch  False                ignore:log
enable_response_store                        switch  False                default
enable_return_aux_hidden_states              switch  False                default
enable_return_hidden_states                  switch  False                default
enable_return_indexer_topk                   switch  False                default
enable_return_routed_experts                 switch  False                default
enable_scattered_sconv                       switch  False                default
enable_session_radix_cache                   switch  False                default
enable_shared_experts_attn_tp                switch  False                default
enable_single_batch_overlap                  switch  False                ignore:perf
enable_ssl_refresh                           switch  False                default
enable_streaming_session                     switch  False                default
enable_strict_thinking                       switch  False                default
enable_symm_mem                              switch  False                ignore:perf
enable_tf32_matmul                           bool    None                 ignore:perf
enable_tokenizer_batch_encode                switch  False                ignore:perf
enable_torch_compile                         switch  False                ignore:perf
enable_torch_compile_debug_mode              switch  False                ignore:perf
enable_torch_symm_mem                        switch  False                ignore:perf
enable_tp_lm_head_all_to_all                 bool    None                 default
enable_trace                                 switch  False                ignore:log
enable_two_batch_overlap                     switch  False                ignore:perf
enable_unified_cache_external_linker         switch  False                default
enable_unified_memory                        switch  False                default
enable_w4a4_mxfp4_megamoe                    switch  False                default
enable_waterfill                             switch  False                default
enable_watermark                             switch  False                default
enable_weights_cpu_backup                    switch  False                ours
encoder_bootstrap_port                       int     8997                 default
encoder_only                                 switch  False                default
encoder_register_urls                        str+    []                   default
encoder_transfer_backend                     str     'auto'               default
encoder_urls                                 str+    []                   default
enforce_disable_flashinfer_allreduce_fusion  switch  False                default
enforce_shared_experts_fusion                switch  False                default
engine_info_bootstrap_port                   int     6789                 default
ep_dispatch_algorithm                        str     None                 default
ep_join_mode                                 str     None                 default
ep_join_rank_offset                          int     0                    default
ep_num_redundant_experts                     int     0                    default
ep_size                                      int     1                    default:1gpu
eplb_algorithm                               str     'auto'               default
eplb_min_rebalancing_utilization_threshold   float   1.0                  default
eplb_rebalance_layers_per_chunk              int     None                 default
eplb_rebalance_num_iterations                int     1000                 default
expert_balancedness_report_mode              str     'off'                default
expert_distribution_recorder_buffer_size     int     None                 default
expert_distribution_recorder_mode            str     None                 default
experts_shared_outer_loras                   bool    None                 default
export_metrics_to_file                       switch  False                ignore:log
export_metrics_to_file_dir                   str     None                 ignore:log
extra_metric_labels                          json    None                 ignore:log
fastapi_root_path                            str     ''                   default
file_storage_path                            str     None                 ignore:launch
flashinfer_a2a_dispatch_type                 str     None                 default
flashinfer_allreduce_fusion_backend          str     None                 default
flashinfer_autotune_skip_ops                 str+    None                 ignore:perf
flashinfer_mla_disable_ragged                switch  False                default
flashinfer_mxfp4_moe_precision               str     'default'            default
flexkv_config_file                           str     None                 default
forward_hooks                                json    None                 default
forward_pass_metrics_ipc_name                str     None                 ignore:log
forward_pass_metrics_worker_id               str     ''                   ignore:log
fp4_gemm_runner_backend                      str     'auto'               ignore:perf
fp8_gemm_runner_backend                      str     'auto'               ignore:perf
fuseep_mode                                  int     2                    default
gated_launch_port                            int     None                 default
gc_threshold                                 int+    None                 ignore:launch
gc_warning_threshold_secs                    float   0.0                  ignore:log
generation_tokens_buckets                    str+    None                 ignore:log
gpu_id_step                                  int     1                    ignore:launch
grammar_backend                              str     None                 ignore:perf
grpc_mode                                    switch  False                default
grpc_port                                    int     None                 default
grpc_response_timeout_secs                   int     300                  default
hf_chat_template_name                        str     None                 default
hicache_host_memory_fraction                 float   0.8                  default
hicache_host_memory_mode                     str     'cache'              default
hicache_io_backend                           str     'kernel'             default
hicache_mem_layout                           str     'page_first'         default
hicache_ratio                                float   None                 default
hicache_size                                 int     0                    default
hicache_storage_backend                      str     None                 default
hicache_storage_backend_extra_config         str     None                 default
hicache_storage_prefetch_policy              str     'timeout'            default
hicache_storage_prefetch_retry_max_attempts  int     8                    default
hicache_storage_prefetch_retry_poll_interval int     8                    default
hicache_write_policy                         str     'write_through'      default
hierarchical_sparse_attention_extra_config   str     None                 default
hisparse_config                              str     None                 default
host                                         str     '127.0.0.1'          ours
http2_initial_connection_window_size         int     1048576              default
http2_max_concurrent_streams                 int     200                  default
hybrid_kvcache_ratio                         str     None                 ignore:deprecated
image_processor_backend                      str     'auto'               default
incremental_streaming_output                 switch  False                ours
init_expert_location                         str     'trivial'            default
int8_mamba_ckpt_size                         int     None                 default
is_embedding                                 switch  False                default:embed
json_model_override_args                     str     '{}'                 default
keep_mm_feature_on_device                    switch  False                default
kt_cpuinfer                                  int     None                 default
kt_max_deferred_experts_per_token            int     None                 default
kt_method                                    str     'AMXINT4'            default
kt_num_gpu_experts                           int     None                 default
kt_threadpool_count                          int     2                    default
kt_weight_path                               str     None                 default
kv_cache_dtype                               str     'auto'               default:quant
kv_canary                                    str     'none'               default
kv_canary_real_data                          str     'none'               default
kv_canary_sweep_interval                     int     0                    default
kv_events_config                             str     None                 default
language_model_only                          switch  False                default
language_only                                switch  False                default
limit_mm_data_per_request                    json    None                 default
linear_attn_backend                          str     'triton'             default
linear_attn_decode_backend                   str     None                 default
linear_attn_prefill_backend                  str     None                 default
linear_attn_verify_backend                   str     None                 default
linear_replayssm_cache_len                   int     16                   default
lmcache_config_file                          str     None                 default
load_balance_method                          str     'auto'               default
load_format                                  str     'auto'               special
load_publish_endpoint                        str     None                 default
load_snapshot_publish_interval               int     15                   default
log_level                                    str     'info'               ours
log_level_http                               str     None                 ignore:log
log_requests                                 switch  False                ignore:log
log_requests_format                          str     'text'               ignore:log
log_requests_level                           int     2                    ignore:log
log_requests_target                          str+    None                 ignore:log
lora_backend                                 str     'csgmv'              ignore:lora
lora_drain_wait_threshold                    float   0.0                  default
lora_eviction_policy                         str     'lru'                ignore:lora
lora_paths                                   str*    None                 default:lora
lora_strict_loading                          bool    False                default
lora_target_modules                          str*    None                 ignore:lora
lora_use_virtual_experts                     switch  False                default
mamba_backend                                str     'triton'             default
mamba_cache_philox_rounds                    int     0                    default
mamba_full_memory_ratio                      float   None                 default
mamba_max_states_per_path                    int     -1                   default
mamba_radix_cache_strategy                   str     'auto'               default
mamba_scheduler_strategy                     str     'auto'               default
mamba_ssm_dtype                              str     None                 default
mamba_track_interval                         int     256                  default
max_ep_size                                  int     None                 default
max_loaded_loras                             int     None                 ignore:lora
max_lora_chunk_size                          int     16                   ignore:lora
max_lora_rank                                int     None                 ignore:lora
max_loras_per_batch                          int     8                    ignore:lora
max_mamba_cache_size                         int     None                 default
max_prefill_tokens                           size    16384                ours
max_queued_requests                          int     None                 ours
max_running_requests                         int     None                 ours
max_total_tokens                             size    None                 ours
media_url_max_file_size_mb                   int     64                   default
mem_fraction_static                          float   None                 ours
min_free_slots_delay                         int     None                 default
mlx_enable_sampling                          switch  False                default
mm_attention_backend                         str     None                 ignore:perf
mm_enable_dp_encoder                         bool    None                 default
mm_feature_transport                         str     None                 default
mm_global_cache_backend                      str     'mooncake'           default
mm_io_worker_num                             int     0                    default
mm_max_concurrent_calls                      int     32                   default
mm_per_request_timeout                       float   10.0                 default
mm_preprocess_cache_size_mb                  int     None                 default
mm_process_config                            json    None                 default
mm_processor_worker_num                      int     0                    default
model_checksum                               str?    None                 default
model_config_parser                          str     'auto'               default
model_impl                                   str     'auto'               default
model_loader_extra_config                    str     '{}'                 ignore:perf
model_path                                   str     None                 ours
modelexpress_config                          str     None                 default
modelopt_checkpoint_restore_path             str     None                 default
modelopt_checkpoint_save_path                str     None                 default
modelopt_export_path                         str     None                 default
modelopt_quant                               str     None                 default
moe_a2a_backend                              str     'none'               default
moe_dense_tp_size                            int     None                 default:1gpu
moe_dp_size                                  int     1                    default:1gpu
moe_runner_backend                           str     'auto'               default
mooncake_ib_device                           str     None                 default
msprobe_dump_config                          str     None                 default
multi_item_scoring_delimiter                 int     None                 default
nccl_port                                    int     None                 ignore:launch
nnodes                                       int     1                    default:1gpu
node_rank                                    int     0                    default:1gpu
nsa_decode_backend                           str     None                 default
nsa_prefill_backend                          str     None                 default
nsa_prefill_cp_mode                          str     'round-robin-split'  default
num_continuous_decode_steps                  int     1                    ignore:perf
num_reserved_decode_tokens                   int     512                  ignore:perf
numa_node                                    int+    None                 ignore:launch
offload_group_size                           int     -1                   default
offload_mode                                 str     'cpu'                default
offload_num_in_group                         int     1                    default
offload_prefetch_step                        int     1                    default
optimistic_prefill_attempts                  int     0                    default
otlp_service_name                            str     None                 ignore:log
otlp_traces_endpoint                         str     'localhost:4317'     ignore:log
page_size                                    int     None                 ours
paged_experts_num_resident                   int     None                 default
pdmux_config_path                            str     None                 default
piecewise_cuda_graph_compiler                str     'eager'              ignore:perf
piecewise_cuda_graph_max_tokens              int     None                 ignore:perf
piecewise_cuda_graph_tokens                  int+    None                 ignore:perf
ple_offload_backend                          str     'pinned'             default
ple_offload_dir                              str     None                 default
ple_offload_embedding                        bool    None                 default
port                                         int     30000                ours
pp_async_batch_depth                         int     0                    default
pp_max_micro_batch_size                      int     None                 default
pp_size                                      int     1                    default:1gpu
pre_warm_nccl                                switch  False                ignore:launch
preferred_sampling_params                    json    None                 default
prefill_attention_backend                    str     None                 ignore:perf
prefill_decode_interval                      int     None                 default
prefill_decode_interval_min_bs               int     0                    default
prefill_delayer_forward_passes_buckets       float+  None                 ignore:log
prefill_delayer_max_delay_ms                 float   None                 default
prefill_delayer_max_delay_passes             int     30                   default
prefill_delayer_queue_min_ratio              float   None                 default
prefill_delayer_token_usage_low_watermark    float   None                 default
prefill_delayer_wait_seconds_buckets         float+  None                 ignore:log
prefill_kv_cache_dequant_dtype               str     'auto'               default
prefill_max_requests                         int     None                 default
prefill_only_disable_kv_cache                switch  False                default
prefill_round_robin_balance                  str     None                 ignore:deprecated
priority_scheduling_preemption_threshold     int     10                   default
prompt_tokens_buckets                        str+    None                 ignore:log
qsa_indexer_dtype                            str     'auto'               default
quantization                                 str     None                 default:quant
quantization_param_path                      str     None                 default
quantize_and_serve                           switch  False                default
radix_cache_backend                          str     None                 default
radix_eviction_policy                        str     'lru'                default
radix_eviction_policy_config                 json    None                 default
random_seed                                  int     None                 ours
reasoning_parser                             str     None                 default
remote_instance_weight_loader_backend        str     'nccl'               default
remote_instance_weight_loader_seed_instance_ip str     None                 default
remote_instance_weight_loader_seed_instance_service_port int     None                 default
remote_instance_weight_loader_send_weights_group_ports json    None                 default
remote_instance_weight_loader_start_seed_via_transfer_engine switch  False                default
retraction_policy                            str     'length'             default
return_aux_hidden_state_layer_ids            int+    None                 default
return_hidden_states_mode                    str     None                 default
return_input_ids                             switch  False                default
return_output_ids                            switch  False                default
revision                                     str     None                 default
rl_on_policy_target                          str     None                 default
rl_quant_profile                             str     None                 default
sampling_backend                             str     None                 ignore:perf
sampling_defaults                            str     'model'              default
sampling_mask_max_tokens                     int     4096                 default
schedule_conservativeness                    float   1.0                  ignore:perf
schedule_low_priority_values_first           switch  False                default
schedule_policy                              str     'fcfs'               ours
scheduler_recv_interval                      int     1                    ignore:launch
served_model_name                            str     None                 ours
shared_experts_tp_size                       int     None                 default
show_time_cost                               switch  False                ignore:log
sidecar                                      str     None                 default
sidecar_args                                 json    None                 default
skip_server_warmup                           switch  False                ignore:launch
skip_tokenizer_init                          switch  False                ignore:tokenizer
sleep_on_idle                                switch  False                ignore:launch
sm_group_num                                 int     8                    default
smg_grpc_mode                                switch  False                default
smg_http_sidecar_port                        int     None                 default
soft_watchdog_timeout                        float   None                 ignore:launch
spec_trace_dir                               str     None                 default
speculative_accept_threshold_acc             float   1.0                  default
speculative_accept_threshold_single          float   1.0                  default
speculative_adaptive                         switch  False                default
speculative_adaptive_config                  str     None                 default
speculative_algorithm                        str     None                 default:spec
speculative_attention_mode                   str     'prefill'            default
speculative_dflash_block_size                int     None                 default
speculative_domino_candidate_pool_size       int     2048                 default
speculative_draft_attention_backend          str     None                 default
speculative_draft_kv_cache_dtype             str     None                 default
speculative_draft_load_format                str     None                 default
speculative_draft_model_path                 str     None                 default:spec
speculative_draft_model_quantization         str     None                 default
speculative_draft_model_revision             str     None                 default
speculative_draft_sink_size                  int     None                 default
speculative_draft_window_size                int     None                 default
speculative_dsa_topk_backend                 str     'sgl-kernel'         default
speculative_dspark_align_verify_tokens_to_graph_tier switch  False                default
speculative_dspark_block_size                int     None                 default
speculative_dspark_confidence_sts_path       str     None                 default
speculative_dspark_sps_table_path            str     None                 default
speculative_eagle_topk                       int     None                 default
speculative_enable_w4a4_mxfp4_megamoe        bool    None                 default
speculative_moe_a2a_backend                  str     None                 default
speculative_moe_runner_backend               str     None                 default
speculative_ngram_branch_length              int     18                   default
speculative_ngram_capacity                   int     10000000             default
speculative_ngram_external_corpus_max_tokens int     10000000             default
speculative_ngram_external_corpus_path       str     None                 default
speculative_ngram_external_sam_budget        int     0                    default
speculative_ngram_match_type                 str     'BFS'                default
speculative_ngram_max_bfs_breadth            int     10                   default
speculative_ngram_max_match_window_size      int     12                   default
speculative_ngram_max_trie_depth             int     18                   default
speculative_ngram_min_bfs_breadth            int     1                    default
speculative_ngram_min_match_window_size      int     1                    default
speculative_num_draft_tokens                 int     None                 default
speculative_num_steps                        int     None                 default
speculative_token_map                        str     None                 default
speculative_use_block_verification           switch  False                default
speculative_use_rejection_sampling           switch  False                default
ssl_ca_certs                                 str     None                 default
ssl_certfile                                 str     None                 default
ssl_keyfile                                  str     None                 default
ssl_keyfile_password                         str     None                 default
startup_weight_load_mode                     str     'serial'             default
stream_interval                              int     1                    ours
stream_output                                switch  False                special
stream_response_default_include_usage        switch  False                default
strip_thinking_cache                         switch  False                default
swa_full_tokens_ratio                        float   None                 default
swa_prefix_tails                             int     None                 default
tbo_token_distribution_threshold             float   0.48                 default
tokenizer_backend                            str     'huggingface'        default
tokenizer_metrics_allowed_custom_labels      str+    None                 ignore:log
tokenizer_metrics_custom_labels_header       str     'x-custom-labels'    ignore:log
tokenizer_mode                               str     'auto'               default
tokenizer_path                               str     None                 ours
tokenizer_worker_num                         int     1                    ignore:launch
tool_call_parser                             str     None                 default
tool_server                                  str     None                 default
torch_compile_max_bs                         int     32                   ignore:perf
torchao_config                               str     ''                   default:quant
tp_size                                      int     1                    default:1gpu
trace_modules                                str     'request'            ignore:log
triton_attention_num_kv_splits               int     8                    ignore:perf
triton_attention_reduce_in_fp32              switch  False                ignore:perf
triton_attention_split_tile_size             int     None                 ignore:perf
trust_mm_content_hashes                      switch  False                default
trust_remote_code                            switch  False                ignore:launch
trust_request_chat_template                  switch  False                default
unified_cache_external_linker_backend        str     'mooncake'           default
unified_cache_external_linker_config         json    None                 default
uno_lora_path                                str     None                 default
use_ray                                      switch  False                default
uvicorn_access_log_exclude_prefixes          str*    []                   ignore:log
warmups                                      str     None                 ignore:launch
watchdog_timeout                             float   300                  ours
watermark_config                             str     None                 default
weight_cache_mode                            str     'off'                default
weight_cache_socket                          str     None                 default
weight_cache_timeout                         int     1800                 default
weight_loader_disable_mmap                   switch  False                ignore:perf
weight_loader_drop_cache_after_load          switch  False                ignore:perf
weight_loader_prefetch_checkpoints           switch  False                ignore:perf
weight_loader_prefetch_num_threads           int     4                    ignore:perf
weight_version                               str     'default'            ours
"""


def _read_table(text: str) -> dict[str, SglangFlag]:
    flags = {}
    for line in text.strip().splitlines():
        name, kind, rest = line.split(None, 2)
        default_text, treatment = rest.rsplit(None, 1)
        what, _, why = treatment.partition(":")
        flags[name] = SglangFlag(name, kind, ast.literal_eval(default_text), what, why)
    return flags


SGLANG_FLAGS: dict[str, SglangFlag] = _read_table(_TABLE)
