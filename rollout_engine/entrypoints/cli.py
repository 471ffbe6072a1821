"""The ``rollout-engine`` console script: ``rollout-engine serve --model-path DIR [flags]``."""

from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: rollout-engine COMMAND [flags]

commands:
  serve    serve a model over HTTP (flags: rollout-engine serve --help)
"""


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from rollout_engine.entrypoints.launch_server import main as serve

        return serve(rest, prog="rollout-engine serve")
    print(f"rollout-engine: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
