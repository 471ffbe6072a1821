"""``vllm serve``'s command line, and what rollout_engine does with each flag: the rules over the
table of ``vllm_flags.py`` (every flag of vLLM 0.32's ``vllm serve`` parser).

    ours:FIELD     the ``EngineConfig`` field FIELD takes the value as given
                   (``--max-num-seqs`` -> ``max_running_requests``)
    special        converted below (``--max-model-len auto``, ``--served-model-name``,
                   ``--speculative-config``, ``--lora-modules``, ...); a value we cannot honour
                   is refused naming the flag
    ignore:WHY     accepted with any value and without effect (WHY: see ``IGNORED``): logging,
                   kernel, launch and multimodal knobs that do not change what is generated
    default[:WHY]  accepted at vLLM's default only; any other value is a
                   ``UnsupportedVllmFlagError`` naming the flag (the launcher exits 2)

A flag absent from the command line keeps our default, except ``--port``, whose default is
vLLM's (8000; the host stays 127.0.0.1), and, with ``--enable-lora`` and no
``--lora-modules``, the adapter pool's size
(``--max-lora-rank`` 16, every projection), which SGLang's rules would otherwise require.
The environment variable ``VLLM_BATCH_INVARIANT=1`` turns on ``enable_deterministic_inference``
(batch-invariant forwards), as it turns on vLLM's batch-invariant mode. A flag on no row is unknown to vLLM 0.32 as well: argparse exits 2
naming it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Optional

from rollout_engine.compat.vllm_flags import VLLM_FLAGS, UnsupportedVllmFlagError, VllmFlag
from rollout_engine.compat.vllm_special import NOTES, SPECIAL, is_default

__all__ = ["IGNORED", "UNSUPPORTED", "VLLM_DEFAULTS", "VLLM_FLAGS", "VLLM_VERSION",
           "UnsupportedVllmFlagError", "VllmFlag", "add_vllm_flags", "human_readable_int",
           "expand_config_file", "markdown", "normalize_argv", "vllm_to_engine_kwargs"]

VLLM_VERSION = "0.32.0"
VLLM_DEFAULTS = {"host": "127.0.0.1", "port": 8000}
"""Defaults of vLLM's command line that differ from ours: port 8000 (ours: 30000, SGLang's).
The host stays 127.0.0.1 (vLLM listens on every interface): ``--host 0.0.0.0`` exposes it."""

UNSUPPORTED = {
    "1gpu": "rollout_engine shards a model only by tensor parallelism (--tensor-parallel-size) "
            "and replicates it by --data-parallel-size on one node: pipeline, context and "
            "expert parallelism and multi-node data parallelism are not implemented",
    "quant": "quantized KV caches and quantization schemes other than --quantization "
             "w8a8_int8 / fp8 are not implemented",
    "offload": "offloading weights or KV to the CPU is not implemented",
    "pd": "KV transfer between instances (disaggregated serving) is not implemented",
    "pooling": "only generative models are served",
    "plugin": "Python plugins and classes loaded into vLLM's processes have no counterpart "
              "here (the engine is not vLLM)",
    "frontend": "this HTTP server option is not implemented (plain HTTP on --host / --port)",
    "": "rollout_engine does not implement this vLLM option",
}
IGNORED = {
    "log": "logging, tracing or metrics knob (rollout_engine always serves /metrics)",
    "launch": "launch detail of vLLM's processes, downloads or loader (one server process "
              "here; models are local directories)",
    "perf": "kernel, compilation or scheduling-speed choice; what is generated does not "
            "depend on it",
    "mm": "multimodal knob: only text models are served",
    "mamba": "state-space-model knob: no such models are served",
    "routes": "option of a route this server does not gate (tool_choice auto, the scale-out "
              "and tokenizer routes are always served) or does not serve (Cohere, Anthropic)",
    "code": "models are this engine's own implementations; no code from a checkpoint is run",
    "lora": "adapters are kept in the served dtype",
}


# -- parsing ---------------------------------------------------------------------------------------
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_readable_int(text: str) -> int:
    """vLLM's sizes: ``4096``, ``32k`` (decimal: k m g t, decimals allowed), ``1K`` (binary:
    K M G T, whole numbers)."""
    text = text.strip()
    m = _SIZE.fullmatch(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer or size: {text!r}") from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"binary suffixes take whole numbers: {text!r}")
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)


def _size_or_auto(text: str) -> int:
    return -1 if text.strip() in ("-1", "auto") else human_readable_int(text)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from None


def _json_or_str(text: str) -> Any:
    return _json(text) if re.match(r"(?s)^\s*{.*}\s*$", text) else text


_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "size": human_readable_int,
    "size_or_auto": _size_or_auto, "json": _json, "json_or_str": _json_or_str,
    "lora_modules": str}


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        return None if text in ("", "None") else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")
    return parse_or_none


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every row's flag (and the optional positional MODEL). A flag absent from the command
    line is absent from the namespace (``argparse.SUPPRESS``)."""
    for name, flag in VLLM_FLAGS.items():
        common: dict[str, Any] = {"default": argparse.SUPPRESS}
        if name == "model_tag":
            parser.add_argument("model_tag", nargs="?", metavar="MODEL", **common,
                                help="model directory (or --model)")
            continue
        common.update(dest=name, help=argparse.SUPPRESS)
        if flag.kind == "switch":
            parser.add_argument(*flag.option_strings, action="store_true", **common)
        elif flag.kind == "bool":
            parser.add_argument(*flag.option_strings, action=argparse.BooleanOptionalAction,
                                **common)
        else:
            base = flag.kind.rstrip("+?")
            nargs = flag.kind[len(base):] or None
            parse = _TYPES[base]
            if flag.default is None:
                parse = _optional(parse)
            parser.add_argument(*flag.option_strings, type=parse, nargs=nargs, **common)


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's spellings argparse does not know: ``--max_model_len`` (underscores), ``-O3`` /
    ``-O 3`` (``--optimization-level``), and dotted keys of a JSON flag
    (``--speculative-config.method ngram``), merged into one JSON value."""
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, path = key[2:].partition(".")
            key = "--" + head.replace("_", "-") + dot + path
            if dot:
                if not eq:
                    if i >= len(argv):
                        raise ValueError(f"{key} needs a value")
                    value = argv[i]
                    i += 1
                node = dotted.setdefault("--" + head.replace("_", "-"), {})
                *parents, leaf = path.split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                try:
                    node[leaf] = json.loads(value)
                except ValueError:
                    node[leaf] = value
                continue
            out.append(key + eq + value)
        elif arg.startswith("-O") and len(arg) > 2:
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i < len(argv) and argv[i] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
    for key, value in dotted.items():
        out += [key, json.dumps(value)]
    return out


def expand_config_file(argv: list[str], options: Mapping[str, Any]) -> list[str]:
    """vLLM's ``--config FILE.yaml``: the file's keys become flags (``true`` -> ``--key``,
    ``false`` -> ``--no-key`` where there is one, a list -> its items, a mapping -> JSON), put
    after a leading MODEL and before the other flags, so that the command line wins.
    ``options``: the parser's option strings. ValueError naming the problem."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("--config: more than one config file")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ValueError("--config: no file given")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path!r}: a YAML file (.yaml or .yml)")
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path!r}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r}: a mapping of flag names to values")
    added: list[str] = []
    for key, value in config.items():
        flag = f"--{key}"
        if isinstance(value, bool):
            if value:
                added.append(flag)
            elif f"--no-{key}" in options:
                added.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                added += [flag, *map(str, value)]
        elif isinstance(value, dict):
            added += [flag, json.dumps(value)]
        else:
            added += [flag, str(value)]
    model_first = bool(rest) and not rest[0].startswith("-")
    return rest[:1] + added + rest[1:] if model_first else added + rest


# -- vLLM values -> EngineConfig keywords ---------------------------------------------------------
def vllm_to_engine_kwargs(given: Mapping[str, Any], env: Optional[Mapping[str, str]] = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``given`` (the ``vllm serve`` destinations on the command line, parsed) ->
    (``EngineConfig`` keywords, the ignored flags given with a value not vLLM's default).
    Raises ``UnsupportedVllmFlagError`` naming a flag we cannot honour, ValueError for a
    name on no row. ``env`` is read for ``VLLM_BATCH_INVARIANT``."""
    out: dict[str, Any] = dict(VLLM_DEFAULTS)
    ignored: dict[str, Any] = {}
    unknown = sorted(set(given) - set(VLLM_FLAGS))
    if unknown:
        raise ValueError(f"not flags of vllm serve {VLLM_VERSION}: {', '.join(unknown)}")
    for name, value in given.items():
        flag = VLLM_FLAGS[name]
        if flag.treatment == "ours":
            if value is not None:      # vLLM's "choose for me": our default chooses
                out[flag.detail] = value
        elif flag.treatment == "special":
            out.update(SPECIAL[name](flag, value, given))
        elif flag.treatment == "ignore":
            if not is_default(flag, value):
                ignored[name] = value
        elif not is_default(flag, value):
            raise UnsupportedVllmFlagError(
                flag, value, f"{UNSUPPORTED[flag.detail]} (only vLLM's default "
                             f"{flag.default!r} is accepted; see docs/VLLM_CLI.md)")
    if (env or {}).get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0"):
        out["enable_deterministic_inference"] = True
    if out.get("enable_lora") and not out.get("lora_paths"):
        # vLLM sizes the adapter pool itself: rank 16, every projection
        out.setdefault("max_lora_rank", VLLM_FLAGS["max_lora_rank"].default)
        out.setdefault("lora_target_modules", ["all"])
    return out, ignored


def markdown() -> str:
    """docs/VLLM_CLI.md's tables: every row, by treatment (and reason)."""
    def names(rows: list[VllmFlag]) -> str:
        return ", ".join(f"`{f.option}`" for f in sorted(rows, key=lambda f: f.option))

    rows = sorted(VLLM_FLAGS.values(), key=lambda f: f.option)
    out = [f"Mapped onto the engine (vllm serve {VLLM_VERSION}):", "",
           "| flag | here |", "|---|---|"]
    for f in rows:
        if f.treatment == "ours":
            out.append(f"| `{f.option}` | `{f.detail}` |")
        elif f.treatment == "special":
            out.append(f"| `{f.option}` | {NOTES[f.name]} |")
    out += ["", "Accepted with any value, without effect:", ""]
    for key, why in IGNORED.items():
        group = [f for f in rows if f.treatment == "ignore" and f.detail == key]
        out.append(f"- {why}: {names(group)}")
    out += ["", "Accepted at vLLM's default only (any other value exits 2 naming the flag):", ""]
    for key, why in UNSUPPORTED.items():
        group = [f for f in rows if f.treatment == "default" and f.detail == key]
        if group:
            out.append(f"- {why}: {names(group)}")
    return "\n".join(out) + "\n"
