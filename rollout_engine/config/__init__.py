"""Engine configuration: one frozen dataclass whose fields are the server flags.

Names follow SGLang's ``ServerArgs`` so that ``Engine(model_path=..., page_size=16)`` and
``launch_server --page-size 16`` mean the same thing. Validation raises ``ValueError`` naming the
field; values discovered at run time (number of KV slots, EOS ids) live on the objects that
discover them, never here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from rollout_engine.compat.server_args import SGLANG_FLAGS, to_engine_kwargs
from rollout_engine.config import speculative as spec_options
from rollout_engine.config.deterministic import check_deterministic
from rollout_engine.config.disaggregation import check_disaggregation
from rollout_engine.config.generation_defaults import read_sampling_defaults
from rollout_engine.config.lora import check_lora
from rollout_engine.config.quantization import check_quantization
from rollout_engine.dp.dispatch import LOAD_BALANCE_METHODS
from rollout_engine.parsers import reasoning_parser_problem, tool_call_parser_problem

_DTYPES = {"auto", "float32", "float16", "bfloat16"}
_POLICIES = {"lpm", "fcfs"}
_BACKENDS = {None, "torch_native", "triton", "flashinfer"}
_GRAMMAR_BACKENDS = {"xgrammar", "none"}
_SAMPLING_DEFAULTS = ("model", "openai")
_KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}   # besides "auto"


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""The ``logprobs_mode`` values served (vLLM's names)."""


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine. ``None`` means "choose from the machine and the model"."""

    model_path: str
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: Optional[int] = None
    # KV memory
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.8
    page_size: int = 1
    # scheduling
    max_running_requests: Optional[int] = None
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 16384
    schedule_policy: str = "lpm"
    schedule_lpm_fallback_queue_len: int = 128
    disable_radix_cache: bool = False
    # hierarchical KV cache (SGLang's HiCache): host tier L2 under the radix tree, optional
    # storage tier L3 (see rollout_engine/memory/hicache/)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0          # host pool = ratio x device pool (unless hicache_size)
    hicache_size: int = 0               # host pool in GB; 0: use hicache_ratio
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: Optional[str] = None   # "file" or None (no L3)
    hicache_storage_prefetch_policy: str = "timeout"
    # ours: the file backend's directory (SGLang reads SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR;
    # without either, the user's cache directory; it must be private to the user), its size
    # bound, and the storage block length in tokens (a multiple of page_size)
    hicache_storage_dir: Optional[str] = None
    hicache_storage_max_gb: float = 16.0
    hicache_storage_block_tokens: int = 64
    hicache_storage_flush: bool = False   # ours: a cache flush also deletes our own L3 blocks
    random_seed: Optional[int] = None   # None: a fresh seed per engine (get_server_info)
    # structured output (json_schema / regex / ebnf / structural_tag): "xgrammar" | "none"
    grammar_backend: str = "xgrammar"
    # JSON whitespace under a schema: SGLang's default allows any amount between tokens (a weak
    # model can loop on it); these two bound it
    constrained_json_disable_any_whitespace: bool = False
    constrained_json_max_whitespace_cnt: Optional[int] = None
    # model runner
    attention_backend: Optional[str] = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    num_threads: Optional[int] = None
    # batch-invariant forwards (SGLang's flag): a request's tokens and logprobs are the same
    # bits whatever runs beside it (rollout_engine/models/batch_invariant.py)
    enable_deterministic_inference: bool = False
    # speculative decoding (SGLang's flags; rollout_engine/config/speculative.py says what each
    # does): None | "NGRAM"
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_max_batch_size: int = 8   # ours: larger decode batches run without speculation
    speculative_draft_model_path: Optional[str] = None   # STANDALONE's draft (same tokenizer)
    # RL control plane
    enable_weights_cpu_backup: bool = False
    # rollout routing replay (R3), SGLang's flag: on a mixture-of-experts model, record the
    # experts every token was routed to (memory/routing_store.py) so a request may ask for
    # them (return_routed_experts)
    enable_return_routed_experts: bool = False
    # SGLang's flag, reported by get_server_info (slime checks it against its own setting);
    # release_memory_occupation frees memory whether or not it is set
    enable_memory_saver: bool = False
    # LoRA adapters served per request (SGLang's flags; config/lora.py says what each does)
    enable_lora: bool = False
    lora_paths: Optional[list[Any]] = None
    max_loras_per_batch: int = 8
    max_lora_rank: Optional[int] = None
    lora_target_modules: Optional[list[str]] = None
    max_loaded_loras: Optional[int] = None
    weight_version: str = "default"
    weight_update_group_timeout: float = 30.0   # s the rendezvous with a trainer may take
    # vLLM's --logprobs-mode: raw_logprobs (the model's distribution, before any sampling
    # transform) or processed_logprobs (after temperature, penalties and top-k / top-p / min-p)
    logprobs_mode: str = "raw_logprobs"
    # prefill-decode disaggregation (config/disaggregation.py)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_transfer_timeout: float = 300.0
    # process model / serving
    scheduler_mode: str = "process"
    dp_size: int = 1                     # scheduler replicas behind one frontend (rollout_engine/dp)
    tp_size: int = 1                     # tensor-parallel ranks, a process each (parallel/)
    dist_timeout: Optional[int] = None   # s a TP collective may take (None: watchdog_timeout)
    load_balance_method: str = "auto"    # dp/dispatch.py: round_robin, total_requests, ...
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    log_level: str = "warning"
    stream_interval: int = 1
    # /generate and Engine.generate(stream=True) chunks carry only what is new (SGLang's flag);
    # by default each carries everything so far, as SGLang streams. OpenAI routes stream deltas.
    incremental_streaming_output: bool = False
    debug_integrity: bool = False
    watchdog_timeout: float = 300.0
    dead_scheduler_exit_delay: float = 3.0   # server answers /health 503 this long, then exits 1
    # HTTP limits
    max_request_body_bytes: int = 32 * 1024 * 1024
    max_refit_body_bytes: int = 1024 * 1024 * 1024   # /update_weights_from_tensor
    max_queued_requests: Optional[int] = None   # in flight in the frontend; more get 503
    # per-request costs (over a cap: a 400 naming it); vLLM's max_logprobs default of 20
    max_top_logprobs_num: int = 20
    max_stop_strings: int = 64
    max_stop_str_len: int = 256        # characters; the stop check decodes ~4x this many tokens
    max_stop_token_ids: int = 1024
    # chat templates: a request's own (chat_template, chat_template_kwargs.chat_template) is
    # refused unless trusted (vLLM's rule); every render is bounded in time and size
    trust_request_chat_template: bool = False
    max_template_render_s: float = 5.0
    # OpenAI chat output (SGLang's flags; rollout_engine/parsers/): tool calls in this format
    # become message.tool_calls (None: <tool_call> blocks), the think block reasoning_content
    # (None: not split)
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    # what a chat request omits of temperature, top_p, top_k, min_p, repetition_penalty:
    # "model" (SGLang's default) takes it from the model's generation_config.json, "openai"
    # leaves SamplingParams' defaults (config/generation_defaults.py)
    sampling_defaults: str = "model"
    # SGLang's KV cache dtype: "auto" or the served dtype's name (bf16 / bfloat16 when the
    # model runs in bfloat16); the KV cache is always kept in the served dtype
    kv_cache_dtype: str = "auto"
    # SGLang's --quantization: None (the model's dtype), "w8a8_int8" or "fp8"
    # (rollout_engine/quantization); a quantized checkpoint's own config.json names it too
    quantization: Optional[str] = None
    # SGLang flags given that change nothing here (logging, kernel and launch knobs;
    # load_format), as given: get_server_info reports them (compat/server_args.py)
    ignored_sglang_args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"EngineConfig.{field}: {why}")

        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            bad("model_path", "must be a non-empty path to a Hugging Face model directory")
        if not os.path.isdir(self.model_path):
            bad("model_path", f"{self.model_path!r} is not a directory (no downloads at run time)")
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            bad("model_path", f"{self.model_path!r} has no config.json: not a Hugging Face model")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.name != "model_path":
                _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.dtype not in _DTYPES:
            bad("dtype", f"must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.page_size < 1:
            bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            bad("max_total_tokens", f"must be >= page_size, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            bad("mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            bad("chunked_prefill_size", f"must be >= 1, got {self.chunked_prefill_size}")
        if self.cuda_graph_max_bs < 1:
            bad("cuda_graph_max_bs", f"must be >= 1, got {self.cuda_graph_max_bs}")
        if self.max_prefill_tokens < 1:
            bad("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.schedule_policy not in _POLICIES:
            bad("schedule_policy", f"must be one of {sorted(_POLICIES)}, got {self.schedule_policy!r}")
        if self.grammar_backend not in _GRAMMAR_BACKENDS:
            bad("grammar_backend", f"must be one of {sorted(_GRAMMAR_BACKENDS)}, got "
                f"{self.grammar_backend!r} (outlines and llguidance are not built in)")
        if (self.constrained_json_max_whitespace_cnt is not None
                and self.constrained_json_max_whitespace_cnt < 0):
            bad("constrained_json_max_whitespace_cnt",
                f"must be >= 0, got {self.constrained_json_max_whitespace_cnt}")
        _check_hicache(self, bad)
        if self.attention_backend not in _BACKENDS:
            bad("attention_backend", f"must be one of {sorted(map(str, _BACKENDS))}")
        check_deterministic(self, bad)
        if self.dp_size < 1:
            bad("dp_size", f"must be >= 1, got {self.dp_size}")
        _check_tp(self, bad)
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            bad("load_balance_method", f"must be one of {list(LOAD_BALANCE_METHODS)}, "
                f"got {self.load_balance_method!r}")
        if self.scheduler_mode not in ("process", "thread"):
            bad("scheduler_mode", f"must be 'process' or 'thread', got {self.scheduler_mode!r}")
        if self.context_length is not None and self.context_length < 2:
            bad("context_length", f"must be >= 2, got {self.context_length}")
        if not 0 <= self.port < 65536:
            bad("port", f"must be in [0, 65535], got {self.port}")
        if self.stream_interval < 1:
            bad("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if not self.dead_scheduler_exit_delay >= 0:
            bad("dead_scheduler_exit_delay", f"must be >= 0, got {self.dead_scheduler_exit_delay}")
        if not isinstance(self.weight_version, str):
            bad("weight_version", "must be a string")
        for name in ("max_request_body_bytes", "max_refit_body_bytes"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1 byte, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            bad("max_queued_requests", f"must be >= 1 (or None: no limit), "
                f"got {self.max_queued_requests}")
        for name in ("max_top_logprobs_num", "max_stop_strings", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.max_stop_str_len < 1:
            bad("max_stop_str_len", f"must be >= 1 character, got {self.max_stop_str_len}")
        if not self.max_template_render_s > 0:
            bad("max_template_render_s", f"must be > 0 seconds, got {self.max_template_render_s}")
        _check_serving(self, bad)
        object.__setattr__(self, "speculative_algorithm",
                           spec_options.normalized_algorithm(self.speculative_algorithm))
        for name, why in spec_options.check(self):
            bad(name, why)
        check_lora(self, bad)
        check_quantization(self, bad)
        check_disaggregation(self, bad)
        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", f"must be one of {list(LOGPROBS_MODES)}, "
                f"got {self.logprobs_mode!r}")
        if self.logprobs_mode != "raw_logprobs" and self.speculative_algorithm is not None:
            bad("logprobs_mode", f"{self.logprobs_mode!r} is not served with speculative "
                "decoding (its verified tokens report raw logprobs); use raw_logprobs")
        if not self.weight_update_group_timeout > 0:
            bad("weight_update_group_timeout",
                f"must be > 0 seconds, got {self.weight_update_group_timeout}")
        _check_ignored_args(self.ignored_sglang_args, bad)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword flags: our fields and SGLang's ``ServerArgs`` names, treated as
        ``rollout_engine/compat/server_args.py`` says (``tp_size=2`` is ours, ``pp_size=2`` is
        an ``UnsupportedFlagError``). A flag neither knows is a ValueError that names it."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        kwargs, unknown = to_engine_kwargs(kwargs, defaults)
        if unknown:
            raise ValueError(f"unknown engine flag(s): {', '.join(sorted(unknown))} (neither "
                             "EngineConfig's nor SGLang's ServerArgs')")
        if "model_path" not in kwargs:
            raise ValueError("EngineConfig.model_path: required (a Hugging Face model directory)")
        return cls(**kwargs)

    # -- derived values ---------------------------------------------------------------------
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # float32 on CPU: the compiled CPU kernels (attention, fused ops, the flat decode
            # loop, packed weights) are float32 paths; bfloat16 on CUDA
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolved_attention_backend(self) -> str:
        """torch_native on CPU; on CUDA flashinfer when it is installed and the model runs in
        16-bit floats (its kernels have no float32 path), else the Triton kernels."""
        if self.attention_backend is not None:
            return self.attention_backend
        if self.resolved_device().type != "cuda":
            return "torch_native"
        half = self.resolved_dtype() in (torch.float16, torch.bfloat16)
        return "flashinfer" if half and _importable("flashinfer") else "triton"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            d[secret] = None if d[secret] is None else "***"
        return d


def _check_tp(c: EngineConfig, bad: Any) -> None:
    """Tensor parallelism: a size that shards this model, and the features it combines with."""
    from rollout_engine.parallel.context import check_tp_size
    from rollout_engine.weights.loader import read_hf_config

    if c.tp_size < 1:
        bad("tp_size", f"must be >= 1, got {c.tp_size}")
    if c.dist_timeout is not None and c.dist_timeout <= 0:
        bad("dist_timeout", f"must be > 0 seconds, got {c.dist_timeout}")
    if c.tp_size == 1:
        return
    why = check_tp_size(c.tp_size, read_hf_config(str(c.model_path)))
    if why is not None:
        bad("tp_size", why)
    if c.scheduler_mode != "process":
        bad("scheduler_mode", "tp_size > 1 runs every rank in its own process: use 'process'")
    for name, on in (("speculative_algorithm", c.speculative_algorithm is not None),
                     ("enable_hierarchical_cache", c.enable_hierarchical_cache)):
        if on:
            bad(name, f"is not supported with tp_size > 1 yet (got tp_size={c.tp_size})")


def _check_serving(c: EngineConfig, bad: Any) -> None:
    """The output parsers, the sampling defaults' source and the KV cache dtype."""
    for name, problem in (("tool_call_parser", tool_call_parser_problem(c.tool_call_parser)),
                          ("reasoning_parser", reasoning_parser_problem(c.reasoning_parser))):
        if problem is not None:
            bad(name, problem)
    if c.sampling_defaults not in _SAMPLING_DEFAULTS:
        bad("sampling_defaults", f"must be one of {list(_SAMPLING_DEFAULTS)}, "
            f"got {c.sampling_defaults!r}")
    if c.sampling_defaults == "model":
        try:
            read_sampling_defaults(str(c.model_path))
        except ValueError as e:
            bad("sampling_defaults", f"'model' reads {e}; fix the file or use 'openai' "
                "(--sampling-defaults openai) to ignore it")
    served = c.resolved_dtype() if c.kv_cache_dtype != "auto" else None
    if served is not None and _KV_CACHE_DTYPES.get(c.kv_cache_dtype) != served:
        named = "'auto', 'bf16', 'bfloat16'" if served == torch.bfloat16 else "'auto'"
        bad("kv_cache_dtype", f"{c.kv_cache_dtype!r} is not supported: the KV cache is kept in "
            f"the served dtype ({str(served).removeprefix('torch.')} here; bf16 / bfloat16 "
            "name it when the model runs in bfloat16, and quantized KV caches such as "
            f"fp8_e4m3 are not implemented); accepted here: {named}")


_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def _check_hicache(c: EngineConfig, bad: Any) -> None:
    """The hierarchical-cache flags (only checked for what they would change)."""
    if c.hicache_write_policy not in _WRITE_POLICIES:
        bad("hicache_write_policy", f"must be one of {list(_WRITE_POLICIES)}, "
            f"got {c.hicache_write_policy!r}")
    if c.hicache_storage_prefetch_policy not in _PREFETCH_POLICIES:
        bad("hicache_storage_prefetch_policy", f"must be one of {list(_PREFETCH_POLICIES)}, "
            f"got {c.hicache_storage_prefetch_policy!r}")
    if not c.hicache_ratio > 0:
        bad("hicache_ratio", f"must be > 0, got {c.hicache_ratio}")
    if c.hicache_size < 0:
        bad("hicache_size", f"must be >= 0 GB, got {c.hicache_size}")
    if c.hicache_storage_backend not in (None, "file"):
        bad("hicache_storage_backend", f"{c.hicache_storage_backend!r} is not built in (only "
            "'file'; mooncake, hf3fs and nixl are not implemented)")
    if not c.hicache_storage_max_gb > 0:
        bad("hicache_storage_max_gb", f"must be > 0, got {c.hicache_storage_max_gb}")
    if c.hicache_storage_block_tokens < 1 or c.hicache_storage_block_tokens % c.page_size:
        bad("hicache_storage_block_tokens", f"must be a positive multiple of page_size "
            f"({c.page_size}), got {c.hicache_storage_block_tokens}")
    if c.enable_hierarchical_cache and c.disable_radix_cache:
        bad("enable_hierarchical_cache", "needs the radix cache (drop disable_radix_cache)")
    if c.hicache_storage_flush and c.hicache_storage_backend is None:
        bad("hicache_storage_flush", "needs hicache_storage_backend")
    if c.hicache_storage_backend is not None and not c.enable_hierarchical_cache:
        bad("hicache_storage_backend", "needs enable_hierarchical_cache")
    if c.enable_hierarchical_cache and c.enable_return_routed_experts:
        bad("enable_hierarchical_cache", "is not supported with enable_return_routed_experts: "
            "the routing record lives with the device KV, and the host and storage tiers would "
            "bring KV back without it")


def _check_ignored_args(args: Any, bad: Any) -> None:
    """Only SGLang flags that change nothing here (``ignore`` rows, ``load_format``)."""
    if not isinstance(args, dict):
        bad("ignored_sglang_args", f"must be a dict of SGLang flags, got {args!r}")
    wrong = sorted(k for k in args if k != "load_format" and (
        k not in SGLANG_FLAGS or SGLANG_FLAGS[k].treatment != "ignore"))
    if wrong:
        bad("ignored_sglang_args", f"{wrong} are not SGLang flags this engine ignores; give "
            "them as flags (SGLang's names are accepted as keyword arguments)")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _check_type(name: str, value: Any, hint: Any) -> None:
    """A flag of the wrong type is a ValueError naming it (bools are not numbers here)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) is Union and type(None) in args
    if optional and value is None:
        return
    kind = next(a for a in args if a is not type(None)) if optional else hint
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, (str, os.PathLike) if name.endswith("_path") else str)
    else:
        return
    if not ok:
        what = kind.__name__ + (" or None" if optional else "")
        raise ValueError(f"EngineConfig.{name}: must be {what}, got {value!r}")
