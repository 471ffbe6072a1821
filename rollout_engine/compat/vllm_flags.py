"""Every flag of ``vllm serve`` (vLLM 0.32) as one text table: the destination name, how the
command line parses it, vLLM's default, and our treatment. Data only; ``vllm_args.py`` reads it
and holds the rules (what each treatment means), ``vllm_special.py`` the ``special``
conversions.

``kind``: switch (store_true), bool (``--x`` / ``--no-x``), int, float, str, size (vLLM's
``human_readable_int``: ``1k`` = 1000, ``1K`` = 1024), size_or_auto (a size, ``-1`` or ``auto``),
json (a JSON object or list), json_or_str (JSON when it looks like an object, else text),
lora_modules (``NAME=PATH`` or JSON); ``+`` a list of one or more, ``?`` an optional value.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

__all__ = ["VLLM_ALIASES", "VLLM_FLAGS", "UnsupportedVllmFlagError", "VllmFlag"]

# name                                      kind          vLLM default           treatment
VLLM_FLAG_TABLE = """
additional_config                            json_or_str   {}                     default
aggregate_engine_logging                     switch        False                  ignore:log
all2all_backend                              str           'allgather_reducescatter' ignore:perf
allow_credentials                            bool          False                  default:frontend
allow_deprecated_quantization                bool          False                  ignore:code
allowed_headers                              json          ['*']                  default:frontend
allowed_local_media_path                     str           ''                     ignore:mm
allowed_media_domains                        str+          None                   ignore:mm
allowed_methods                              json          ['*']                  default:frontend
allowed_origins                              json          []                     default:frontend
anthropic_disabled_thinking_effort           str           'auto'                 ignore:routes
api_key                                      str+          None                   special
api_server_count                             int           None                   ignore:launch
async_scheduling                             bool          None                   ignore:perf
attention_backend                            str           None                   ignore:perf
attention_config                             json          {}                     ignore:perf
aux_output_config                            json          {}                     special
block_size                                   int           None                   ours:page_size
chat_template                                str           None                   default
chat_template_content_format                 str           'auto'                 default
code_revision                                str           None                   ignore:launch
cohere_format                                str           'cmd4'                 ignore:routes
cohere_is_reasoning_model                    bool          True                   ignore:routes
collect_detailed_traces                      str+          None                   ignore:log
compilation_config                           json          {}                     ignore:perf
config                                       str           None                   special
config_format                                str           'auto'                 ignore:launch
convert                                      str           'auto'                 special
cp_kv_cache_interleave_size                  int           None                   default:1gpu
cpu_distributed_timeout_seconds              int           None                   ignore:launch
cpu_offload_gb                               float         0                      default:offload
cpu_offload_params                           str+          []                     default:offload
cudagraph_capture_sizes                      int+          None                   ignore:perf
cudagraph_metrics                            bool          False                  ignore:log
custom_histogram_buckets                     json          None                   ignore:log
data_parallel_address                        str           None                   default:1gpu
data_parallel_backend                        str           'mp'                   default:1gpu
data_parallel_external_lb                    bool          False                  default:1gpu
data_parallel_hybrid_lb                      bool          False                  default:1gpu
data_parallel_multi_port_external_lb         switch        False                  default:1gpu
data_parallel_rank                           int           None                   default:1gpu
data_parallel_rpc_port                       int           None                   default:1gpu
data_parallel_size                           int           1                      ours:dp_size
data_parallel_size_local                     int           None                   default:1gpu
data_parallel_start_rank                     int           None                   default:1gpu
data_parallel_supervisor_port                int           9256                   ignore:launch
dbo_decode_token_threshold                   int           32                     default:1gpu
dbo_prefill_token_threshold                  int           512                    default:1gpu
dcp_comm_backend                             str           None                   default:1gpu
dcp_kv_cache_interleave_size                 int           1                      default:1gpu
dcp_q_replicate                              bool          None                   default:1gpu
decode_context_parallel_size                 int           1                      default:1gpu
default_chat_template_kwargs                 json          None                   default
default_mm_loras                             json          None                   ignore:mm
device_ids                                   str           None                   default:1gpu
diffusion_config                             json          None                   default
disable_access_log_for_endpoints             str           None                   ignore:log
disable_cascade_attn                         bool          None                   ignore:perf
disable_chunked_mm_input                     bool          False                  ignore:mm
disable_custom_all_reduce                    bool          False                  ignore:perf
disable_fastapi_docs                         bool          False                  ignore:launch
disable_hybrid_kv_cache_manager              bool          None                   ignore:perf
disable_log_stats                            switch        False                  ignore:log
disable_nccl_for_dp_synchronization          bool          None                   default:1gpu
disable_sliding_window                       bool          False                  default
disable_uvicorn_access_log                   bool          False                  ignore:log
distributed_executor_backend                 str           None                   ignore:launch
distributed_timeout_seconds                  int           None                   ours:dist_timeout
download_dir                                 str           None                   ignore:launch
dp_supervisor_probe_failure_threshold        int           3                      ignore:launch
dp_supervisor_probe_interval_s               float         5.0                    ignore:launch
dp_supervisor_probe_timeout_s                float         5.0                    ignore:launch
dp_sync_interval                             int           16                     default:1gpu
dtype                                        str           'auto'                 special
ec_manager_config                            json          {}                     default:pd
ec_transfer_config                           json          None                   default:pd
elastic_ep_max_dp_size                       int           None                   default:1gpu
enable_auto_tool_choice                      bool          False                  ignore:routes
enable_batch_sharded_sampling                bool          None                   default:1gpu
enable_chunked_prefill                       bool          None                   ignore:perf
enable_cumem_allocator                       bool          False                  ignore:perf
enable_dbo                                   bool          False                  default:1gpu
enable_elastic_ep                            bool          False                  default:1gpu
enable_ep_weight_filter                      bool          False                  default:1gpu
enable_eplb                                  bool          False                  default:1gpu
enable_expert_parallel                       bool          False                  default:1gpu
enable_fault_tolerance                       bool          False                  default
enable_flash_late_interaction                bool          True                   ignore:routes
enable_flashinfer_autotune                   bool          None                   ignore:perf
enable_force_include_usage                   bool          False                  default
enable_hc_sp                                 bool          False                  default:1gpu
enable_layerwise_nvtx_tracing                bool          False                  ignore:log
enable_log_deltas                            bool          True                   ignore:log
enable_log_outputs                           bool          False                  ignore:log
enable_log_requests                          bool          False                  ignore:log
enable_logging_iteration_details             bool          False                  ignore:log
enable_lora                                  bool          None                   ours:enable_lora
enable_mamba_cache_stochastic_rounding       bool          False                  ignore:mamba
enable_mamba_shared_prefix_checkpoint        bool          False                  ignore:mamba
enable_mfu_metrics                           bool          False                  ignore:log
enable_mixed_moe_lora_format                 bool          False                  default
enable_mm_embeds                             bool          False                  ignore:mm
enable_moe_shared_loras                      bool          False                  default
enable_nccl_comm_suspend                     bool          False                  ignore:perf
enable_offline_docs                          bool          False                  ignore:launch
enable_per_request_metrics                   bool          False                  ignore:log
enable_prefix_caching                        bool          None                   special
enable_prompt_embeds                         bool          False                  default
enable_prompt_tokens_details                 bool          False                  ignore:log
enable_request_id_headers                    bool          False                  default:frontend
enable_return_routed_experts                 bool          False                  ours:enable_return_routed_experts
enable_scale_out                             bool          False                  ignore:routes
enable_server_load_tracking                  bool          False                  ignore:log
enable_shm_tensor_arena                      bool          False                  default:1gpu
enable_sleep_mode                            bool          False                  ours:enable_memory_saver
enable_ssl_refresh                           bool          False                  default:frontend
enable_tokenizer_info_endpoint               bool          False                  ignore:routes
enable_tower_connector_lora                  bool          False                  ignore:mm
enable_trace_replay                          bool          False                  default
enforce_eager                                bool          False                  ours:disable_cuda_graph
engram_config                                json          None                   default
eplb_config                                  json          {}                     default:1gpu
exclude_tools_when_tool_choice_none          bool          False                  default
expert_placement_strategy                    str           'linear'               default:1gpu
fail_on_environ_validation                   bool          False                  ignore:launch
fault_tolerance_config                       json          {}                     ignore:launch
fingerprint_mode                             str           'full'                 ignore:routes
fingerprint_value                            str           None                   ignore:routes
fully_sharded_loras                          bool          False                  ignore:perf
gdn_prefill_backend                          str           None                   ignore:perf
generation_config                            str           'auto'                 special
gpu_memory_utilization                       float         0.92                   ours:mem_fraction_static
grpc                                         switch        False                  default:frontend
grpc_port                                    int           None                   default:frontend
h11_max_header_count                         int           256                    ignore:launch
h11_max_incomplete_event_size                int           4194304                ignore:launch
headless                                     switch        False                  default:1gpu
hf_config_path                               str           None                   default
hf_overrides                                 json_or_str   {}                     default
hf_token                                     str?          None                   ignore:launch
host                                         str           None                   ours:host
ignore_patterns                              str+          ['original/**/*']      ignore:launch
interleave_mm_strings                        bool          False                  ignore:mm
io_processor_plugin                          str           None                   default:plugin
ir_op_priority                               json          {}                     ignore:perf
jit_monitor_mode                             str           'warn'                 ignore:log
jit_monitor_verbose                          bool          False                  ignore:log
kda_decode_backend                           str           None                   ignore:perf
kda_prefill_backend                          str           None                   ignore:perf
kernel_config                                json          {}                     ignore:perf
kv_cache_dtype                               str           'auto'                 special
kv_cache_dtype_skip_layers                   str+          []                     default:quant
kv_cache_memory_bytes                        size          None                   default
kv_cache_metrics                             bool          False                  ignore:log
kv_cache_metrics_sample                      float         0.01                   ignore:log
kv_events_config                             json          None                   default:pd
kv_offloading_backend                        str           'native'               default:offload
kv_offloading_size                           float         None                   default:offload
kv_sharing_fast_prefill                      bool          False                  ignore:perf
kv_transfer_config                           json          None                   default:pd
language_model_only                          bool          False                  ignore:mm
limit_mm_per_prompt                          json          {}                     ignore:mm
linear_backend                               str           'auto'                 ignore:perf
load_format                                  str           'auto'                 special
log_config_file                              str           None                   ignore:log
log_error_stack                              bool          False                  ignore:log
log_level                                    str           None                   special
logging_config                               json          None                   ignore:log
logits_processors                            str+          None                   default:plugin
logprobs_mode                                str           'raw_logprobs'         special
long_prefill_token_threshold                 int           0                      ignore:perf
long_prefill_token_threshold_adaptive        bool          False                  ignore:perf
lora_dtype                                   str           'auto'                 ignore:lora
lora_modules                                 lora_modules+ None                   special
lora_target_modules                          str+          None                   ours:lora_target_modules
mamba_backend                                str           'triton'               ignore:mamba
mamba_block_size                             int           None                   ignore:mamba
mamba_cache_dtype                            str           'auto'                 ignore:mamba
mamba_cache_mode                             str           'none'                 ignore:mamba
mamba_cache_philox_rounds                    int           0                      ignore:mamba
mamba_ssm_cache_dtype                        str           'auto'                 ignore:mamba
mamba_ssu_algorithm                          str           None                   ignore:mamba
master_addr                                  str           '127.0.0.1'            ignore:launch
master_port                                  int           29501                  ignore:launch
max_cpu_loras                                int           None                   ours:max_loaded_loras
max_cudagraph_capture_size                   int           None                   ours:cuda_graph_max_bs
max_log_len                                  int           None                   ignore:log
max_logprobs                                 int           20                     special
max_lora_cls_labels                          int           None                   default
max_lora_rank                                int           16                     ours:max_lora_rank
max_loras                                    int           1                      ours:max_loras_per_batch
max_model_len                                size_or_auto  None                   special
max_num_active_seqs                          int           None                   default
max_num_batched_tokens                       size          None                   special
max_num_queued_reqs                          int           None                   default
max_num_queued_tokens                        size          None                   default
max_num_scheduled_tokens                     size          None                   ignore:perf
max_num_seqs                                 int           None                   ours:max_running_requests
max_parallel_loading_workers                 int           None                   ignore:launch
media_io_kwargs                              json          {}                     ignore:mm
middleware                                   str+          []                     default:plugin
mm_device_do_normalize                       bool          None                   ignore:mm
mm_encoder_attn_backend                      str           None                   ignore:mm
mm_encoder_attn_dtype                        str           None                   ignore:mm
mm_encoder_fp8_scale_path                    str           None                   ignore:mm
mm_encoder_fp8_scale_save_margin             float         1.5                    ignore:mm
mm_encoder_fp8_scale_save_path               str           None                   ignore:mm
mm_encoder_only                              bool          False                  ignore:mm
mm_encoder_tp_mode                           str           'weights'              ignore:mm
mm_hasher_algorithm                          str           'blake3'               ignore:mm
mm_ipc_gpu_memory_gb                         float         0                      ignore:mm
mm_processor_cache_gb                        float         4                      ignore:mm
mm_processor_cache_type                      str           'lru'                  ignore:mm
mm_processor_device                          str           'auto'                 ignore:mm
mm_processor_kwargs                          json          None                   ignore:mm
mm_shm_cache_max_object_size_mb              int           128                    ignore:mm
mm_tensor_ipc                                str           'direct_rpc'           ignore:mm
model                                        str           'Qwen/Qwen3-0.6B'      special
model_class_overrides                        json          {}                     default:plugin
model_impl                                   str           'auto'                 ignore:perf
model_loader_extra_config                    json_or_str   {}                     ignore:perf
model_tag                                    str?          None                   special
moe_backend                                  str           'auto'                 ignore:perf
nnodes                                       int           1                      default:1gpu
node_rank                                    int           0                      default:1gpu
num_gpu_blocks_override                      int           None                   special
numa_bind                                    bool          False                  ignore:launch
numa_bind_cpus                               str+          None                   ignore:launch
numa_bind_nodes                              int+          None                   ignore:launch
offload_backend                              str           'auto'                 default:offload
offload_group_size                           int           0                      default:offload
offload_num_in_group                         int           1                      default:offload
offload_params                               str+          []                     default:offload
offload_prefetch_step                        int           1                      default:offload
optimization_level                           str           2                      ignore:perf
otlp_traces_endpoint                         str           None                   ignore:log
override_generation_config                   json          {}                     default
per_request_spec_decode_metrics              str           'none'                 ignore:log
performance_mode                             str           'balanced'             ignore:perf
pipeline_parallel_size                       int           1                      default:1gpu
pooler_config                                json          None                   default:pooling
port                                         int           8000                   ours:port
prefill_context_parallel_size                int           1                      default:1gpu
prefill_schedule_interval                    int           1                      ignore:perf
prefix_cache_retention_interval              int           0                      default
prefix_caching_hash_algo                     str           'sha256'               ignore:perf
prefix_match_unit                            int           None                   default
profiler_config                              json          {}                     ignore:log
pt_load_map_location                         json_or_str   'cpu'                  ignore:launch
quantization                                 str           None                   special
quantization_config                          json          None                   default:quant
ray_workers_use_nsight                       bool          False                  ignore:log
reasoning_config                             json          None                   default
reasoning_parser                             str           ''                     special
reasoning_parser_plugin                      str           ''                     default:plugin
renderer_num_workers                         int           1                      ignore:perf
replayssm_buffer_len                         int           16                     ignore:mamba
response_role                                str           'assistant'            default
return_sampling_mask                         bool          False                  default
return_tokens_as_token_ids                   bool          False                  default
revision                                     str           None                   ignore:launch
root_path                                    str           None                   default:frontend
runner                                       str           'auto'                 special
safetensors_load_strategy                    str           None                   ignore:perf
safetensors_prefetch_block_size              size          16777216               ignore:perf
safetensors_prefetch_num_threads             int           8                      ignore:perf
scheduler_cls                                str           None                   default:plugin
scheduler_reserve_full_isl                   bool          True                   ignore:perf
scheduling_policy                            str           'fcfs'                 special
seed                                         int           0                      ours:random_seed
served_model_name                            str+          None                   special
show_hidden_metrics_for_version              str           None                   ignore:log
shutdown_timeout                             int           0                      ignore:launch
skip_mm_profiling                            bool          False                  ignore:mm
skip_tokenizer_init                          bool          False                  default
sleep_mode_offload_cudagraph                 bool          False                  ignore:perf
sleep_preserve_parameter_names               str+          []                     default
sparse_indexer_topk_backend                  str           'auto'                 ignore:perf
spec_method                                  str           None                   special
spec_model                                   str           None                   special
spec_tokens                                  int           None                   special
specialize_active_lora                       bool          False                  default
speculative_config                           json          None                   special
sse_keep_alive_interval                      int           0                      ignore:launch
ssl_ca_certs                                 str           None                   default:frontend
ssl_cert_reqs                                int           0                      default:frontend
ssl_certfile                                 str           None                   default:frontend
ssl_ciphers                                  str           None                   default:frontend
ssl_keyfile                                  str           None                   default:frontend
stream_interval                              int           1                      ours:stream_interval
structured_outputs_config                    json          {}                     special
swa_bounded_replay                           bool          True                   ignore:perf
tensor_parallel_size                         int           1                      ours:tp_size
tokenizer                                    str           None                   ours:tokenizer_path
tokenizer_mode                               str           'auto'                 ignore:perf
tokenizer_revision                           str           None                   ignore:launch
tokens_only                                  bool          False                  default:pd
tool_call_parser                             str           None                   special
tool_parser_plugin                           str           ''                     default:plugin
tool_server                                  str           None                   default:plugin
tool_strict_level                            str           'auto'                 default
trust_remote_code                            bool          False                  ignore:code
trust_request_chat_template                  bool          False                  ours:trust_request_chat_template
trust_request_mm_kwargs                      bool          False                  ignore:mm
ubatch_size                                  int           0                      default:1gpu
uds                                          str           None                   default:frontend
use_fp64_gumbel                              bool          False                  default
use_replayssm                                bool          False                  ignore:mamba
use_tqdm_on_load                             bool          True                   ignore:log
uvicorn_log_level                            str           'info'                 ignore:log
video_pruning_method                         str           'evs'                  ignore:mm
video_pruning_rate                           float         None                   ignore:mm
watermark                                    float         0.0                    default
watermark_config                             json          None                   default
weight_transfer_config                       json          None                   special
worker_cls                                   str           'auto'                 default:plugin
worker_extension_cls                         str           ''                     default:plugin
"""

# option strings besides ``--<name-with-dashes>`` (and ``--no-...`` of a bool)
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    'api_server_count': ('-asc',),
    'attention_config': ('-ac',),
    'compilation_config': ('-cc',),
    'data_parallel_address': ('-dpa',),
    'data_parallel_backend': ('-dpb',),
    'data_parallel_external_lb': ('-dpe',),
    'data_parallel_hybrid_lb': ('-dph',),
    'data_parallel_multi_port_external_lb': ('-dpm',),
    'data_parallel_rank': ('-dpn',),
    'data_parallel_rpc_port': ('-dpp',),
    'data_parallel_size': ('-dp',),
    'data_parallel_size_local': ('-dpl',),
    'data_parallel_start_rank': ('-dpr',),
    'decode_context_parallel_size': ('-dcp',),
    'diffusion_config': ('-dc',),
    'enable_expert_parallel': ('-ep',),
    'gpu_memory_utilization': ('--device-memory-utilization',),
    'nnodes': ('-n',),
    'node_rank': ('-r',),
    'pipeline_parallel_size': ('-pp',),
    'prefill_context_parallel_size': ('-pcp',),
    'quantization': ('-q',),
    'speculative_config': ('-sc',),
    'tensor_parallel_size': ('-tp',),
}


@dataclass(frozen=True)
class VllmFlag:
    """One row: a ``vllm serve`` destination, how its flag parses, vLLM's default, our
    treatment."""

    name: str
    kind: str
    default: Any
    treatment: str     # ours | special | ignore | default
    detail: str = ""   # the EngineConfig field (ours), else a key of vllm_args' reasons

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Its flags (``--no-x`` besides for a bool); none for the positional MODEL."""
        if self.name == "model_tag":
            return ()
        return ("--" + self.name.replace("_", "-"), *VLLM_ALIASES.get(self.name, ()))

    @property
    def option(self) -> str:
        return self.option_strings[0] if self.option_strings else "MODEL"


class UnsupportedVllmFlagError(ValueError):
    """A ``vllm serve`` flag given a value rollout_engine cannot honour; names the flag."""

    def __init__(self, flag: VllmFlag, value: Any, why: str) -> None:
        super().__init__(f"{flag.option} {value!r}: {why}")
        self.flag = flag


def _read_table(text: str) -> dict[str, VllmFlag]:
    flags = {}
    for line in text.strip().splitlines():
        name, kind, rest = line.split(None, 2)
        default_text, treatment = rest.rsplit(None, 1)
        what, _, detail = treatment.partition(":")
        flags[name] = VllmFlag(name, kind, ast.literal_eval(default_text), what, detail)
    return flags


VLLM_FLAGS: dict[str, VllmFlag] = _read_table(VLLM_FLAG_TABLE)
