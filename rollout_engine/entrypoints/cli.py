"""The ``rollout-engine`` console script.

    rollout-engine serve --model-path DIR [flags]   SGLang's command line (launch_server)
    rollout-engine serve DIR [flags]                vLLM's: ``vllm serve DIR [flags]``
    rollout-engine vllm-serve DIR [flags]           vLLM's, the model anywhere or --model DIR

Both start the same server (SGLang's and vLLM's routes)."""

from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: rollout-engine COMMAND [flags]

commands:
  serve       serve a model over HTTP: SGLang's flags (rollout-engine serve --help), or
              vllm serve's when the model directory comes first (rollout-engine serve MODEL ...)
  vllm-serve  serve a model over HTTP from vllm serve's flags (rollout-engine vllm-serve --help)
"""


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "vllm-serve" or (command == "serve" and rest and not rest[0].startswith("-")):
        from rollout_engine.entrypoints.vllm_serve import main as vllm_serve

        return vllm_serve(rest, prog=f"rollout-engine {command}")
    if command == "serve":
        from rollout_engine.entrypoints.launch_server import main as serve

        return serve(rest, prog="rollout-engine serve")
    print(f"rollout-engine: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
