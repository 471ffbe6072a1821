"""``python -m rollout_engine.launch_server --model-path DIR --port 30000 [flags]``.

Every ``EngineConfig`` field is a flag (``page_size`` -> ``--page-size``; booleans are switches),
so ``Engine(**kwargs)`` and the server take the same options; so is every flag of
``python -m sglang.launch_server``, treated as ``rollout_engine/compat/server_args.py`` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Optional, Union

from rollout_engine.compat.server_args import (
    IGNORED_ARGS_FIELD,
    SGLANG_FLAGS,
    SGLANG_VERSIONS,
    UnsupportedFlagError,
    add_sglang_flags,
    parse_size,
    to_engine_kwargs,
)
from rollout_engine.config import EngineConfig

HELP: dict[str, str] = {
    "model_path": "Hugging Face model directory (config.json, *.safetensors, tokenizer).",
    "tokenizer_path": "Tokenizer directory, when it differs from --model-path.",
    "dtype": "Weights and activations: auto (bfloat16 on GPU, float32 on CPU), float32, "
             "float16 or bfloat16.",
    "device": "auto, cpu, cuda or cuda:N.",
    "context_length": "Longest sequence (prompt + output); default: the model's.",
    "max_total_tokens": "KV cache capacity in tokens; default: from --mem-fraction-static.",
    "mem_fraction_static": "Fraction of accelerator memory for weights and KV cache.",
    "page_size": "Tokens per KV page (the radix cache matches whole pages).",
    "max_running_requests": "Most requests in the running batch; default: from the KV size.",
    "chunked_prefill_size": "Most prompt tokens prefilled per step; longer prompts are chunked.",
    "max_prefill_tokens": "Token budget of one prefill batch.",
    "schedule_policy": "Admission order: lpm (longest prefix match first) or fcfs.",
    "schedule_lpm_fallback_queue_len": "Above this many waiting requests, lpm falls back to fcfs.",
    "disable_radix_cache": "Do not reuse KV across requests (no prefix cache).",
    "enable_hierarchical_cache": "HiCache: KV the device pool evicts is kept in a host tier (and "
                                 "with --hicache-storage-backend in storage) and loaded back.",
    "hicache_ratio": "Host tier size as a multiple of the device KV pool.",
    "hicache_size": "Host tier size in GB (overrides --hicache-ratio when > 0).",
    "hicache_write_policy": "write_through (copy to the host at insert), "
                            "write_through_selective (at the second hit) or write_back (at "
                            "eviction).",
    "hicache_storage_backend": "Storage tier (L3): file (a directory engines may share).",
    "hicache_storage_prefetch_policy": "How long a request waits aside for its storage reads "
                                       "(later requests are admitted meanwhile): best_effort, "
                                       "wait_complete or timeout.",
    "hicache_storage_dir": "Directory of the file storage tier, private to this user (mode "
                           "0700; one others may write is refused). Default: "
                           "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else "
                           "$XDG_CACHE_HOME/rollout_engine/hicache (~/.cache/...).",
    "hicache_storage_max_gb": "Size bound of the file storage tier; LRU blocks are deleted.",
    "hicache_storage_block_tokens": "Tokens per storage block (a multiple of --page-size).",
    "hicache_storage_flush": "Every cache flush (flush_cache, a refit's flush, sleeping with "
                             "kv_cache) also deletes the storage blocks this engine wrote.",
    "grammar_backend": "Structured output (json_schema / regex / ebnf / structural_tag): "
                       "xgrammar, or none to refuse every constraint with a 400.",
    "constrained_json_disable_any_whitespace": "JSON under a schema is compact: no whitespace "
                                               "between tokens (a weak model may emit it "
                                               "forever).",
    "constrained_json_max_whitespace_cnt": "At most this many whitespace characters in a row "
                                           "in JSON under a schema.",
    "random_seed": "Seed of the frontend's per-request seeds (reproducible sampling); "
                   "default: a fresh seed per engine, reported by /get_server_info.",
    "attention_backend": "torch_native, triton or flashinfer; default: triton on GPU, "
                         "torch_native on CPU.",
    "disable_cuda_graph": "Run decode eagerly (no CUDA graph capture).",
    "cuda_graph_max_bs": "Largest decode batch captured in a CUDA graph.",
    "num_threads": "torch CPU threads of the scheduler process.",
    "enable_deterministic_inference": "Batch-invariant forwards (CPU float32): a request's "
                                      "tokens and logprobs are the same bits whatever runs "
                                      "beside it; trainer_bridge.on_policy scores them exactly.",
    "speculative_algorithm": "NGRAM: speculative decoding with proposals from each request's own "
                             "tokens; STANDALONE: from a small draft model; verified in one "
                             "forward (outputs and logprobs exact).",
    "speculative_draft_model_path": "STANDALONE's draft model directory (same tokenizer).",
    "speculative_num_steps": "Proposals per step when --speculative-num-draft-tokens is not "
                             "given (draft tokens = steps + 1).",
    "speculative_num_draft_tokens": "Tokens per verify forward: the last token plus this many "
                                    "minus one proposals; default: the max match window.",
    "speculative_eagle_topk": "Draft branching; 1 (drafts are one chain).",
    "speculative_ngram_min_match_window_size": "Shortest suffix an n-gram proposal matches.",
    "speculative_ngram_max_match_window_size": "Longest suffix an n-gram proposal matches.",
    "speculative_max_batch_size": "Decode batches larger than this run without speculation "
                                  "(0: never speculate).",
    "enable_weights_cpu_backup": "Keep a CPU copy of the weights so they survive a release.",
    "enable_return_routed_experts": "Mixture-of-experts models: record the experts every "
                                    "token was routed to, for requests that ask "
                                    "(return_routed_experts; rollout routing replay).",
    "enable_memory_saver": "SGLang's memory-saver flag, reported by /get_server_info; "
                           "/release_memory_occupation frees memory either way.",
    "weight_version": "Version label of the initial weights (reported with every output).",
    "weight_update_group_timeout": "Seconds init_weights_update_group may wait for the trainer "
                                   "to join the rendezvous.",
    "logprobs_mode": "Which logprobs a request reports (vLLM's --logprobs-mode): raw_logprobs "
                     "(the model's distribution) or processed_logprobs (after temperature, "
                     "penalties and top-k / top-p / min-p).",
    "scheduler_mode": "process (a child process, default) or thread (same process).",
    "host": "Address to bind; 127.0.0.1 unless you mean to expose the server.",
    "port": "TCP port to listen on.",
    "dp_size": "Data parallelism: this many scheduler replicas (each a full model copy) behind "
               "one frontend; control calls reach every replica.",
    "tp_size": "Tensor parallelism: shard the model over this many scheduler processes on "
               "this machine (gloo on CPU, nccl on GPUs base .. base + N - 1); every refit "
               "path, sleep / wake and check_integrity cover all ranks.",
    "dist_timeout": "Seconds one tensor-parallel collective may take before the engine fails "
                    "instead of hanging (default: --watchdog-timeout).",
    "load_balance_method": "Which replica a request goes to with --dp-size > 1: auto / "
                           "round_robin, total_requests (shortest_queue), total_tokens "
                           "(minimum_tokens), or cache_aware (prefix affinity, load fallback).",
    "api_key": "Require 'Authorization: Bearer KEY' on every route.",
    "admin_api_key": "Require this key on control routes (weights, memory, flush, abort_all).",
    "served_model_name": "Model name reported by /v1/models and in OpenAI responses.",
    "log_level": "debug, info, warning or error.",
    "stream_interval": "Stream a chunk every this many tokens.",
    "incremental_streaming_output": "Stream chunks of /generate carry only the new text, ids "
                                    "and logprobs (default: everything so far, as SGLang).",
    "debug_integrity": "Check the KV invariant whenever the scheduler goes idle (slow).",
    "watchdog_timeout": "Seconds to wait for the scheduler to start or answer a control call.",
    "dead_scheduler_exit_delay": "Seconds the server answers /health 503 after the scheduler "
                                 "dies, before it exits with status 1.",
    "max_request_body_bytes": "Largest request body (bytes); a bigger one gets 413.",
    "max_refit_body_bytes": "Largest body of /update_weights_from_tensor (bytes).",
    "max_queued_requests": "Most requests in flight at once; more get 503 (default: no limit).",
    "max_top_logprobs_num": "Most top logprobs per token a request may ask for "
                            "(top_logprobs_num, OpenAI logprobs / top_logprobs); more get 400.",
    "max_stop_strings": "Most stop strings per request; more get 400.",
    "max_stop_str_len": "Longest stop string in characters (each step decodes about 4x this "
                        "many tokens to check it); longer get 400.",
    "max_stop_token_ids": "Most stop_token_ids per request; more get 400.",
    "trust_request_chat_template": "Render a chat template sent with a request (chat_template, "
                                   "chat_template_kwargs.chat_template); by default such a "
                                   "request gets 400 and the server's own template is used.",
    "max_template_render_s": "Seconds one chat-template render may take; a slower one gets "
                             "400.",
    "tool_call_parser": "Tool calls in chat output become message.tool_calls in this format: "
                        "qwen / qwen25 / hermes (<tool_call> blocks) or llama3 (JSON calls, "
                        "<|python_tag|>); default: <tool_call> blocks.",
    "reasoning_parser": "Split the think block of chat output into reasoning_content: "
                        "deepseek-r1, qwen3, qwen3-thinking (and SGLang's aliases step3, "
                        "step3p5, interns1, minimax); default: no split.",
    "sampling_defaults": "model: a chat request's omitted temperature / top_p / top_k / min_p "
                         "/ repetition_penalty come from the model's generation_config.json "
                         "(SGLang's default); openai: the usual defaults.",
    "enable_lora": "Serve LoRA adapters per request (lora_path / the OpenAI model name); "
                   "implied by --lora-paths.",
    "lora_paths": "Adapters loaded at start: NAME=DIR, DIR, or JSON {\"lora_name\", "
                  "\"lora_path\", \"pinned\"} (PEFT directories).",
    "max_loras_per_batch": "Adapter slots: distinct adapters one batch may use.",
    "max_lora_rank": "Largest adapter rank (default: the largest of --lora-paths').",
    "lora_target_modules": "Projections adapters may target: q_proj k_proj v_proj o_proj "
                           "gate_proj up_proj down_proj, or all (default: those of "
                           "--lora-paths).",
    "max_loaded_loras": "Most adapters loaded at once (default: no limit).",
    "kv_cache_dtype": "KV cache dtype: auto (the served dtype), or bf16 / bfloat16 when the "
                      "model runs in bfloat16; quantized KV caches are not implemented.",
    "quantization": "Quantized weights: w8a8_int8 (int8 weights per row, int8 activations per "
                    "token) or fp8 (128 x 128 e4m3 blocks); a quantized checkpoint's own "
                    "method is read from its config.json.",
    "disaggregation_mode": "Prefill-decode disaggregation: null (a whole server), prefill or "
                           "decode (a pair behind a PD router).",
    "disaggregation_bootstrap_port": "Prefill server: the TCP port decode servers fetch a "
                                     "prompt's KV from.",
    "disaggregation_transfer_backend": "How KV moves between a pair: auto (shared memory on "
                                       "one host, TCP otherwise; SGLang's mooncake / nixl mean "
                                       "it here), shm, tcp.",
    "disaggregation_transfer_timeout": "Seconds a decode server waits for a prompt's KV, and a "
                                       "prefill server keeps KV no decode server fetched.",
}


def _base_type(tp: Any) -> Any:
    """``Optional[int]`` -> ``int``."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """Our flags (one per ``EngineConfig`` field, SGLang's spellings where they are SGLang's
    too: ``--model``, ``--context-length 32k``), then every other flag of
    ``python -m sglang.launch_server`` (hidden from ``--help``; see ``compat/server_args.py``)."""
    parser = argparse.ArgumentParser(
        prog=prog or "python -m rollout_engine.launch_server",
        description="Serve a model over HTTP with SGLang's API (rollout_engine).",
        epilog=f"Every flag of python -m sglang.launch_server (sglang "
               f"{', '.join(SGLANG_VERSIONS)}) is accepted too: mapped to the flags above, "
               "ignored when it cannot change what is generated (logging, kernels, launch "
               "details), or accepted at SGLang's default only (--tp-size 1); any other value "
               "exits with status 2 naming the flag. The table: "
               "rollout_engine/compat/server_args.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == IGNORED_ARGS_FIELD:   # filled from SGLang's own flags, not a flag itself
            continue
        sglang = SGLANG_FLAGS.get(f.name)
        flags = sglang.option_strings if sglang else ("--" + f.name.replace("_", "-"),)
        tp = _base_type(hints[f.name])
        help_text = HELP.get(f.name, f"EngineConfig.{f.name}.")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if tp is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_text)
            continue
        if sglang is not None and sglang.kind == "size":
            tp = parse_size
        parser.add_argument(*flags, dest=f.name, type=tp if tp in (int, float, parse_size)
                            else str, required=required, help=help_text,
                            nargs="*" if typing.get_origin(tp) is list else None,
                            default=None if required else f.default)
    add_sglang_flags(parser, skip={f.name for f in dataclasses.fields(EngineConfig)})
    return parser


def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> dict[str, Any]:
    """Flags -> ``EngineConfig`` keyword arguments: ours that differ from the defaults (so that
    the config's own defaults stay the single source) and SGLang's, translated. An SGLang flag
    given a value we cannot honour exits with status 2 (argparse's ``error``) naming it."""
    parser = build_parser(prog)
    ns = vars(parser.parse_args(argv))
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    given = {k: v for k, v in ns.items()
             if k not in defaults or k == "model_path" or v != defaults[k]}
    try:
        kwargs, unknown = to_engine_kwargs(given, defaults)
    except UnsupportedFlagError as e:
        parser.error(str(e))
    if unknown:   # argparse only produces dests it was given; a stale table would land here
        parser.error(f"flag(s) with no treatment: {', '.join(unknown)}")
    return kwargs


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    return serve(parse_args(argv, prog), prog or "python -m rollout_engine.launch_server")


def serve(kwargs: dict[str, Any], prog: str) -> int:
    """Validate ``kwargs`` as an ``EngineConfig`` (exit status 2 with the reason), then run the
    server until it stops; both command lines (SGLang's and vLLM's) end here."""
    try:
        EngineConfig.from_kwargs(**kwargs)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from rollout_engine.entrypoints.http_server import run_server  # heavy: after validation

    return run_server(kwargs)


if __name__ == "__main__":
    sys.exit(main())
