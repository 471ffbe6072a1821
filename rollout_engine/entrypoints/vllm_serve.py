"""``rollout-engine vllm-serve MODEL [flags]`` (``python -m rollout_engine.entrypoints.vllm_serve``):
the server started from ``vllm serve``'s command line (vLLM 0.32).

Every flag of ``vllm serve`` parses as vLLM parses it (``--max_model_len`` too, ``-tp 2``,
``-O3``, ``--speculative-config.method ngram``, ``--config FILE.yaml``) and is treated as the
table of ``rollout_engine/compat/vllm_flags.py`` says: mapped onto ``EngineConfig``, accepted without
effect, or refused naming the flag (exit status 2). An unknown flag exits 2 naming it. The server
is the same one ``launch_server`` starts, so SGLang's routes and vLLM's are both served; it
listens on vLLM's default port, 8000, on 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Optional

from rollout_engine.compat.vllm_args import (
    IGNORED,
    VLLM_FLAGS,
    VLLM_VERSION,
    add_vllm_flags,
    expand_config_file,
    normalize_argv,
    vllm_to_engine_kwargs,
)
from rollout_engine.entrypoints.launch_server import serve

__all__ = ["build_parser", "main", "parse_args"]

logger = logging.getLogger(__name__)
PROG = "python -m rollout_engine.entrypoints.vllm_serve"


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """Every flag of ``vllm serve`` (hidden from ``--help``: docs/VLLM_CLI.md lists them)."""
    parser = argparse.ArgumentParser(
        prog=prog or PROG, usage=f"{prog or PROG} MODEL [vllm serve flags]",
        description=f"Serve a model over HTTP from vllm serve's command line (vLLM "
                    f"{VLLM_VERSION}); SGLang's routes are served too.",
        epilog="Each flag of vllm serve is mapped onto the engine's settings, accepted without "
               "effect (logging, kernel and launch knobs), or refused naming the flag (exit "
               "status 2); the table is in docs/VLLM_CLI.md. VLLM_BATCH_INVARIANT=1 turns on "
               "batch-invariant (deterministic) inference.")
    add_vllm_flags(parser)
    return parser


def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None,
               env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """``vllm serve`` flags -> ``EngineConfig`` keyword arguments. A flag vLLM 0.32 does not
    have, or one given a value we cannot honour, exits with status 2 naming it."""
    parser = build_parser(prog)
    try:
        args = normalize_argv(sys.argv[1:] if argv is None else list(argv))
        args = normalize_argv(expand_config_file(args, parser._option_string_actions))
    except ValueError as e:
        parser.error(str(e))
    given = vars(parser.parse_args(args))
    try:
        kwargs, ignored = vllm_to_engine_kwargs(given, os.environ if env is None else env)
    except ValueError as e:
        parser.error(str(e))
    for name, value in ignored.items():
        flag = VLLM_FLAGS[name]
        logger.info("%s %r ignored: %s", flag.option, value, IGNORED[flag.detail])
    if "model_path" not in kwargs:
        parser.error("the model is required: MODEL (a Hugging Face model directory) or "
                     "--model MODEL")
    return kwargs


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    return serve(parse_args(argv, prog), prog or PROG)


if __name__ == "__main__":
    sys.exit(main())
