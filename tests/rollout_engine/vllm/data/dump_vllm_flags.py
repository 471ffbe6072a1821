"""Write vLLM's ``vllm serve`` flags as JSON (test data for ``test_vllm_flags.py``).

Run once with the interpreter of an environment where vLLM is installed::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 <vllm-env>/bin/python dump_vllm_flags.py > vllm_serve_flags.json

Each entry: the destination name, every option string, and the kind in the vocabulary of
``rollout_engine/compat/vllm_flags.py`` (switch, bool, int, size, size_or_auto, float, str, json,
json_or_str, lora_modules; ``+`` for a list), read from the parser ``vllm serve`` builds.
"""

from __future__ import annotations

import argparse
import json
import sys

_TYPE_KINDS = {"int": "int", "float": "float", "str": "str", "human_readable_int": "size",
               "human_readable_int_or_auto": "size_or_auto", "loads": "json",
               "parse_dataclass": "json", "union_dict_and_str": "json_or_str"}


def _kind(action: argparse.Action) -> str:
    name = type(action).__name__
    if name == "_StoreTrueAction":
        return "switch"
    if name == "BooleanOptionalAction":
        return "bool"
    fn = action.type
    while getattr(fn, "__name__", "") in ("_optional_type", "_parse_type"):
        inner = fn.__closure__[0].cell_contents if fn.__closure__ else None
        if inner is None or not callable(inner):
            break
        fn = inner
    type_name = getattr(fn, "__name__", "str") if fn is not None else "str"
    kind = _TYPE_KINDS.get(type_name, "json" if type_name in ("dict", "_parse_type") else "str")
    if name == "LoRAParserAction":
        kind = "lora_modules"
    if action.nargs == "+" or name == "_AppendAction":
        kind += "+"
    elif action.nargs == "?":
        kind += "?"
    return kind


def main() -> None:
    from vllm import __version__
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags.append({"dest": action.dest, "options": list(action.option_strings),
                      "kind": _kind(action)})
    json.dump({"vllm_version": __version__, "flags": flags}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
