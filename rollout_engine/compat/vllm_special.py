"""The ``special`` rows of ``vllm_flags.py``: a ``vllm serve`` value -> ``EngineConfig``
keywords, or an ``UnsupportedVllmFlagError`` naming the flag for a value we cannot honour.

Each converter takes (the row, the parsed value, every destination given) and returns the
keywords it sets; calling one twice gives the same answer (the four speculative flags each
convert all four together)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollout_engine.compat.vllm_flags import VLLM_FLAGS, UnsupportedVllmFlagError, VllmFlag

__all__ = ["NOTES", "SPECIAL", "is_default"]

Convert = Callable[[VllmFlag, Any, Mapping[str, Any]], dict[str, Any]]


def is_default(flag: VllmFlag, value: Any) -> bool:
    """``value`` means what vLLM's default means: for a switch False and None alike, equal
    numbers, and for a configuration object's default an empty JSON object."""
    default = flag.default
    if flag.kind in ("switch", "bool") and default in (None, False, True) \
            and value in (None, False, True):
        return bool(value) == bool(default)
    if _number(value) and _number(default):
        return bool(value == default)
    if default in ({}, []) and value in ({}, [], None):
        return True
    return type(value) is type(default) and bool(value == default)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _model(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM: the positional MODEL wins over --model
    if flag.name == "model" and given.get("model_tag") is not None:
        return {}
    return {} if value is None else {"model_path": value}


def _dtype(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtype": {"half": "float16", "float": "float32"}.get(value, value)}


def _max_model_len(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value is None or value == -1 else {"context_length": value}


def _one_of_list(field: str, what: str) -> Convert:
    def convert(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if not value:
            return {}
        if len(value) > 1:
            raise UnsupportedVllmFlagError(flag, value, f"one {what} only (this server has "
                                                        f"one {field})")
        return {field: value[0]}
    return convert


def _generation_config(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value == "auto":
        return {"sampling_defaults": "model"}
    if value == "vllm":
        return {"sampling_defaults": "openai"}
    raise UnsupportedVllmFlagError(flag, value, "auto (the model directory's "
                                   "generation_config.json) or vllm (no model defaults) only; "
                                   "a generation config from another directory is not read")


def _prefix_caching(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value is None else {"disable_radix_cache": not value}


def _kv_cache_dtype(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value not in ("auto", "bfloat16"):
        raise UnsupportedVllmFlagError(flag, value, "the KV cache is kept in the served "
                                       "dtype: auto, or bfloat16 when the model runs in "
                                       "bfloat16; quantized KV caches (fp8...) are not "
                                       "implemented")
    return {"kv_cache_dtype": value}


def _max_logprobs(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value < 0:
        raise UnsupportedVllmFlagError(flag, value, "give a number >= 0 (no cap, -1, is not "
                                                    "supported)")
    return {"max_top_logprobs_num": value}


def _batched_tokens(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    # one step's prompt-token budget: the prefill batch and the chunk a long prompt is cut in
    return {} if value is None else {"chunked_prefill_size": value, "max_prefill_tokens": value}


def _gpu_blocks(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    return {"max_total_tokens": value * (given.get("block_size") or 16)}


def _lora_modules(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``NAME=PATH`` or ``{"name", "path", "base_model_name"}`` -> our ``lora_paths``."""
    import json

    paths = []
    for entry in value or ():
        text = entry.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise UnsupportedVllmFlagError(flag, entry, f"not JSON: {e}") from None
            if not isinstance(obj, dict) or not {"name", "path"} <= obj.keys() \
                    or set(obj) - {"name", "path", "base_model_name"}:
                raise UnsupportedVllmFlagError(flag, entry, 'a JSON entry is {"name", "path"} '
                                               '(and "base_model_name")')
            paths.append({"lora_name": obj["name"], "lora_path": obj["path"]})
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise UnsupportedVllmFlagError(flag, entry, "an entry is NAME=PATH or JSON")
        paths.append({"lora_name": name, "lora_path": path})
    return {"lora_paths": paths, "enable_lora": True} if paths else {}


_TOOL_PARSERS = {"llama3_json": "llama3"}   # vLLM's name -> ours where they differ


def _tool_call_parser(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value is None else {"tool_call_parser": _TOOL_PARSERS.get(value, value)}


def _reasoning_parser(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"reasoning_parser": value.replace("_", "-")} if value else {}


_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
              "prompt_lookup_min"}


def _speculative(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``--speculative-config`` with ``--spec-method / --spec-model / --spec-tokens`` merged in:
    ngram -> NGRAM, draft_model (or a model path) -> STANDALONE."""
    spec = given.get("speculative_config")
    flag = VLLM_FLAGS["speculative_config"]
    if spec is not None and not isinstance(spec, dict):
        raise UnsupportedVllmFlagError(flag, spec, "a JSON object")
    spec = {k.replace("-", "_"): v for k, v in (spec or {}).items()}
    for name, key in (("spec_method", "method"), ("spec_model", "model"),
                      ("spec_tokens", "num_speculative_tokens")):
        if given.get(name) is not None:
            if key in spec:
                raise UnsupportedVllmFlagError(VLLM_FLAGS[name], given[name], f"given with "
                                               f"--speculative-config's {key!r}")
            spec[key] = given[name]
    if not spec:
        return {}
    extra = sorted(set(spec) - _SPEC_KEYS)
    if extra:
        raise UnsupportedVllmFlagError(flag, spec, f"keys {extra} are not implemented "
                                       f"(accepted: {sorted(_SPEC_KEYS)})")
    method = spec.get("method") or ("ngram" if spec.get("model") in ("ngram", "[ngram]")
                                    else "draft_model")
    out: dict[str, Any] = {}
    if spec.get("num_speculative_tokens") is not None:
        out["speculative_num_draft_tokens"] = spec["num_speculative_tokens"] + 1
    if method in ("ngram", "[ngram]"):
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        low, high = (low or high or 5), (high or low or 5)
        return {**out, "speculative_algorithm": "NGRAM",
                "speculative_ngram_min_match_window_size": low,
                "speculative_ngram_max_match_window_size": high}
    if method == "draft_model" and spec.get("model"):
        return {**out, "speculative_algorithm": "STANDALONE",
                "speculative_draft_model_path": spec["model"]}
    raise UnsupportedVllmFlagError(flag, spec, "methods ngram and draft_model (with a model "
                                   "directory) are implemented; EAGLE / MTP / suffix drafts "
                                   "are not")


def _structured_outputs(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UnsupportedVllmFlagError(flag, value, "a JSON object")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key == "backend":
            if item not in ("auto", "xgrammar"):
                raise UnsupportedVllmFlagError(flag, value, f"backend {item!r}: structured "
                                               "output is xgrammar's (auto, xgrammar)")
            out["grammar_backend"] = "xgrammar"
        elif key == "disable_any_whitespace":
            out["constrained_json_disable_any_whitespace"] = bool(item)
        elif key != "disable_fallback" and item not in (False, "", None):
            raise UnsupportedVllmFlagError(flag, value, f"{key!r} is not implemented (backend, "
                                           "disable_any_whitespace and disable_fallback are)")
    return out


def _aux_output(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) - {"enable_return_routed_experts",
                                                    "max_bytes"}:
        raise UnsupportedVllmFlagError(flag, value, "a JSON object of "
                                       "enable_return_routed_experts (and max_bytes)")
    if "enable_return_routed_experts" not in value:
        return {}
    return {"enable_return_routed_experts": bool(value["enable_return_routed_experts"])}


def _choice(allowed: tuple[Any, ...], why: str,
            field: str = "", values: Mapping[Any, Any] | None = None) -> Convert:
    """A value among ``allowed`` (mapped to ``field`` through ``values`` when given), else
    refused with ``why``."""
    def convert(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if value not in allowed:
            raise UnsupportedVllmFlagError(flag, value, f"{why} (accepted: "
                                                        f"{', '.join(map(str, allowed))})")
        if not field:
            return {}
        return {field: (values or {}).get(value, value)}
    return convert


def _quantization(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``--quantization``: ``fp8`` is ours (block-wise 128 x 128 where vLLM's online
    fp8 of an unquantized checkpoint is per tensor; a block checkpoint reads the same),
    ``compressed-tensors`` leaves the method to the checkpoint, which names it anyway."""
    if value is None or value == "compressed-tensors":
        return {}
    if value == "fp8":
        return {"quantization": "fp8"}
    raise UnsupportedVllmFlagError(flag, value, "fp8 and compressed-tensors (int8 W8A8 or fp8 "
                                   "block checkpoints) are implemented")


def _weight_transfer(flag: VllmFlag, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    backend = value.get("backend", "nccl") if isinstance(value, dict) else None
    if backend not in ("nccl", "ipc"):
        raise UnsupportedVllmFlagError(flag, value, 'a JSON object {"backend": "nccl"} or '
                                       '{"backend": "ipc"}; other backends are not implemented')
    return {}   # the weight-transfer routes take the backend's details from each call


SPECIAL: dict[str, Convert] = {
    "model_tag": _model, "model": _model, "dtype": _dtype, "max_model_len": _max_model_len,
    "served_model_name": _one_of_list("served_model_name", "name"),
    "api_key": _one_of_list("api_key", "key"),
    "generation_config": _generation_config, "enable_prefix_caching": _prefix_caching,
    "kv_cache_dtype": _kv_cache_dtype, "max_logprobs": _max_logprobs,
    "quantization": _quantization,
    "max_num_batched_tokens": _batched_tokens, "num_gpu_blocks_override": _gpu_blocks,
    "lora_modules": _lora_modules, "tool_call_parser": _tool_call_parser,
    "reasoning_parser": _reasoning_parser, "speculative_config": _speculative,
    "spec_method": _speculative, "spec_model": _speculative, "spec_tokens": _speculative,
    "structured_outputs_config": _structured_outputs, "aux_output_config": _aux_output,
    "load_format": _choice(("auto", "safetensors", "dummy"), "the loader reads safetensors "
                           "(dummy loads them too; a refit overwrites them)"),
    "log_level": _choice(("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET"),
                         "a logging level", "log_level",
                         {"CRITICAL": "error", "ERROR": "error", "WARNING": "warning",
                          "INFO": "info", "DEBUG": "debug", "NOTSET": "debug"}),
    "scheduling_policy": _choice(("fcfs",), "requests are admitted first come first served "
                                 "(priorities are not implemented)", "schedule_policy"),
    "runner": _choice(("auto", "generate"), "only generative models are served"),
    "convert": _choice(("auto", "none"), "only generative models are served"),
    "weight_transfer_config": _weight_transfer,
    "config": lambda flag, value, given: {},   # read before parsing: expand_config_file
    "logprobs_mode": _choice(("raw_logprobs", "processed_logprobs"), "logprobs are served, "
                             "not logits", "logprobs_mode"),
}

# what each special row does, for docs/VLLM_CLI.md
NOTES: dict[str, str] = {
    "model_tag": "the model directory (positional; wins over `--model`)",
    "config": "a YAML file of flags (`key: value`), read first: the command line wins",
    "model": "the model directory (`model_path`)",
    "dtype": "`dtype` (`half` -> float16, `float` -> float32)",
    "max_model_len": "`context_length` (`auto` / -1: the model's; `32k`, `1K` sizes)",
    "served_model_name": "`served_model_name` (one name)",
    "api_key": "`api_key` (one key)",
    "generation_config": "`auto` -> `sampling_defaults` model, `vllm` -> openai; a directory "
                         "is refused",
    "enable_prefix_caching": "`--no-enable-prefix-caching` -> `disable_radix_cache`",
    "kv_cache_dtype": "`kv_cache_dtype`: auto or bfloat16; fp8 caches refused",
    "quantization": "`quantization`: fp8 (block-wise 128 x 128); compressed-tensors: the "
                    "checkpoint's own; others refused",
    "max_logprobs": "`max_top_logprobs_num` (-1, no cap, refused)",
    "max_num_batched_tokens": "`chunked_prefill_size` and `max_prefill_tokens`",
    "num_gpu_blocks_override": "`max_total_tokens` = blocks x `--block-size` (16)",
    "lora_modules": "`lora_paths` (`NAME=PATH` or `{\"name\", \"path\"}`), `enable_lora`",
    "tool_call_parser": "`tool_call_parser` (`llama3_json` -> llama3; hermes ...)",
    "reasoning_parser": "`reasoning_parser` (`deepseek_r1` -> deepseek-r1, qwen3 ...)",
    "speculative_config": "`method` ngram -> NGRAM (prompt_lookup_min/max: the match "
                          "windows), draft_model -> STANDALONE; num_speculative_tokens + 1 "
                          "draft tokens; other methods refused",
    "spec_method": "as `--speculative-config`'s method",
    "spec_model": "as `--speculative-config`'s model",
    "spec_tokens": "as `--speculative-config`'s num_speculative_tokens",
    "structured_outputs_config": "backend auto / xgrammar; `disable_any_whitespace` -> "
                                 "`constrained_json_disable_any_whitespace`",
    "aux_output_config": "`enable_return_routed_experts`",
    "load_format": "auto, safetensors, dummy (reads the real weights); others refused",
    "log_level": "`log_level`",
    "scheduling_policy": "fcfs -> `schedule_policy` fcfs; priority refused",
    "runner": "auto / generate only",
    "convert": "auto / none only",
    "weight_transfer_config": "backend nccl or ipc accepted (the weight routes take the "
                              "details per call); others refused",
    "logprobs_mode": "`logprobs_mode`: raw_logprobs, processed_logprobs (logits modes refused)",
}
