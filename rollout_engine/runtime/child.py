"""Entry point of the scheduler process: ``main([FD, PPID])``.

``spawn_child`` (runtime/spawn.py) runs ``main`` in a fresh interpreter (never importing the
caller's ``__main__``, as multiprocessing's spawn does), hands it one end of a socket pair as
file descriptor ``FD``, and the parent sends ``ChildStart`` as the first message. The process
exits when the parent does: on end-of-file of that socket, or when process ``PPID`` is gone.
It runs the scheduler loop, TP rank 0 (``run_leader``) or a TP rank > 0 (``run_worker``).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

__all__ = ["exit_with_parent", "main"]


def exit_with_parent(parent_pid: int) -> threading.Thread:
    """A daemon thread that ends this process as soon as ``parent_pid`` exits."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(parent_pid)   # readable once the process has exited
            select.select([fd], [], [])
        except (AttributeError, OSError):    # no pidfd here, or the parent is gone already
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        os._exit(0)

    thread = threading.Thread(target=watch, name="rollout-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: Optional[list[str]] = None) -> int:
    fd_arg, ppid_arg = sys.argv[1:] if argv is None else argv
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(int(ppid_arg))
    conn = Connection(int(fd_arg))
    try:
        start = conn.recv()   # spawn.ChildStart
    except (EOFError, OSError):
        return 0   # the parent went away before it sent anything
    sys.path.extend(p for p in start.sys_path if p not in sys.path)
    logging.basicConfig(level=start.config.log_level.upper())
    from rollout_engine.runtime.channels import PipeChannel
    from rollout_engine.runtime.loop import run_loop

    if start.tp is not None:   # tensor-parallel rank > 0, a child of rank 0
        from rollout_engine.runtime.tp_launch import run_worker

        return run_worker(start.config, conn, start.tp)
    try:
        if start.config.tp_size > 1:   # rank 0: starts the other ranks (tp_launch.py)
            from rollout_engine.runtime.tp_launch import run_leader

            run_leader(start.config, PipeChannel(conn))
        else:
            run_loop(start.config, PipeChannel(conn))
    except Exception:  # noqa: BLE001 - reported to the frontend by run_loop
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
