"""``python -m rollout_engine.integrations.verl.serve --parent-pid PID <launch_server flags>``:
``launch_server`` that exits as soon as process ``PID`` (the verl server actor) is gone."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from rollout_engine.entrypoints.launch_server import main as launch_main
from rollout_engine.runtime.child import exit_with_parent


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_engine.integrations.verl.serve",
                                     add_help=False)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns, rest = parser.parse_known_args(argv)
    exit_with_parent(ns.parent_pid)
    return launch_main(rest, prog="rollout_engine server for verl")


if __name__ == "__main__":
    sys.exit(main())
