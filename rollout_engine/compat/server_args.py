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
                   knobs that do not change what is generated (WHY: see ``IGNORED``); the value
                   given is kept (``EngineConfig.ignored_sglang_args``) and reported back
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

from rollout_engine.compat.sglang_flags import SGLANG_FLAG_TABLE

__all__ = ["IGNORED_ARGS_FIELD", "SGLANG_FLAGS", "SGLANG_VERSIONS", "SglangFlag",
           "UnsupportedFlagError", "add_sglang_flags", "parse_size", "server_args_view",
           "to_engine_kwargs"]

logger = logging.getLogger(__name__)

SGLANG_VERSIONS = ("0.5.9", "0.5.23")
IGNORED_ARGS_FIELD = "ignored_sglang_args"
"""The EngineConfig field that keeps the SGLang flags given that change nothing here (every
``ignore`` row, and ``load_format``) as they were given, for ``server_args_view``."""

# why a flag is accepted only at its default (the tag after "default:")
UNSUPPORTED = {
    "1gpu": "rollout_engine shards a model only by tensor parallelism (--tp-size) on one "
            "node: pipeline, expert and context parallelism are not implemented; run one "
            "server per replica (with sglang-router in front)",
    "quant": "quantized KV caches and quantization schemes other than --quantization "
             "w8a8_int8 / fp8 are not implemented",
    "spec": "speculative decoding: --speculative-algorithm NGRAM and STANDALONE (a draft model) "
            "are implemented; EAGLE / MTP drafts are not",
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
    "lora": "LoRA kernel, chunk and eviction choices of SGLang's (adapters here: segment "
            "products in PyTorch, pool slots evicted least recently used)",
    "draft": "no draft model",
    "ngram": "shape of SGLang's n-gram trie / draft tree: lossless, it changes speed only; here "
             "the draft is one chain from the request's own tokens",
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


def _speculative_algorithm(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                           ours: Mapping[str, Any]) -> dict[str, Any]:
    if value is not None and str(value).upper() not in ("NGRAM", "STANDALONE"):
        raise UnsupportedFlagError(flag, value, UNSUPPORTED["spec"])
    return {"speculative_algorithm": value}


def _kv_cache_dtype(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                    ours: Mapping[str, Any]) -> dict[str, Any]:
    if value not in ("auto", "bf16", "bfloat16"):
        raise UnsupportedFlagError(flag, value, "the KV cache is kept in the served dtype: "
                                   "auto is accepted, and bf16 / bfloat16 when the model runs "
                                   "in bfloat16; quantized KV caches (fp8_e5m2, fp8_e4m3, "
                                   "fp4_e2m1) are not implemented")
    return {"kv_cache_dtype": value}


def _rl_on_policy_target(flag: SglangFlag, value: Any, given: Mapping[str, Any],
                         ours: Mapping[str, Any]) -> dict[str, Any]:
    # SGLang's on-policy mode (its trainer named, e.g. "fsdp"): here batch-invariant forwards,
    # scored on the trainer's side by trainer_bridge.on_policy.OnPolicyModel
    return {} if value is None else {"enable_deterministic_inference": True}


_CONVERT: dict[str, Convert] = {
    "dtype": _dtype, "attention_backend": _attention_backend,
    "chunked_prefill_size": _chunked_prefill_size, "base_gpu_id": _base_gpu_id,
    "load_format": _load_format, "stream_output": _stream_output,
    "speculative_algorithm": _speculative_algorithm, "kv_cache_dtype": _kv_cache_dtype,
    "rl_on_policy_target": _rl_on_policy_target,
}


def to_engine_kwargs(given: Mapping[str, Any], ours: Mapping[str, Any]
                     ) -> tuple[dict[str, Any], list[str]]:
    """``given`` (SGLang ``ServerArgs`` names and ``EngineConfig``'s own) -> (``EngineConfig``
    keywords, names neither knows). ``ours`` maps each EngineConfig field to its default.
    Raises ``UnsupportedFlagError`` for a value we cannot honour. Idempotent on its output.
    An ignored flag, and ``load_format``, given a value not SGLang's default is kept under
    ``IGNORED_ARGS_FIELD``."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    specials = []
    kept: dict[str, Any] = {}
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
            if name == "load_format" and not _is_default(flag, value):
                kept[name] = value
        elif flag.treatment == "ignore":
            if not _is_default(flag, value):
                logger.info("%s %r ignored: %s", flag.option, value, IGNORED[flag.why])
                kept[name] = value
        elif not _is_default(flag, value):
            raise _refuse(flag, value)
    for flag, value in specials:     # after the named fields they may refine (device)
        out.update(_CONVERT[flag.name](flag, value, given, ours))
    if kept:
        out[IGNORED_ARGS_FIELD] = {**out.get(IGNORED_ARGS_FIELD, {}), **kept}
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
    """SGLang's ``ServerArgs`` as this engine runs, for ``get_server_info``: every field of the
    table. One we map has our value (``config``: ``EngineConfig.to_dict()``), one accepted only
    at its default has that default, an ignored one (and ``load_format``) the value it was
    given or else SGLang's default; ``base_gpu_id`` and ``stream_output`` follow ``device`` and
    ``incremental_streaming_output``."""
    given = config.get(IGNORED_ARGS_FIELD) or {}
    view: dict[str, Any] = {}
    for name, flag in SGLANG_FLAGS.items():
        if flag.treatment == "ours":
            view[name] = config[name]
        else:
            view[name] = copy.deepcopy(given.get(name, flag.default))
    device = str(config["device"])
    view["base_gpu_id"] = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
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

# the table itself (one row a flag) lives in sglang_flags.py



def _read_table(text: str) -> dict[str, SglangFlag]:
    flags = {}
    for line in text.strip().splitlines():
        name, kind, rest = line.split(None, 2)
        default_text, treatment = rest.rsplit(None, 1)
        what, _, why = treatment.partition(":")
        flags[name] = SglangFlag(name, kind, ast.literal_eval(default_text), what, why)
    return flags


SGLANG_FLAGS: dict[str, SglangFlag] = _read_table(SGLANG_FLAG_TABLE)
