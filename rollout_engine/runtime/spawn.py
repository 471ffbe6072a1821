"""The one way a scheduler process is started: ``spawn_child``.

    parent --Popen(python -c BOOT ROOT FD PPID, pass_fds=[FD])--> child.main([FD, PPID])
    parent --ChildStart (the first message; sent by the caller)--> child

A fresh interpreter, not multiprocessing's spawn: spawn re-imports the caller's main module,
so a script without an ``if __name__ == "__main__":`` guard would start a second Engine in the
child and die with a bare EOFError. The two ends talk over an inherited socket pair (nothing
listens, so no other process can connect). The frontend starts the scheduler (or TP rank 0)
this way; rank 0 starts the other TP ranks the same way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rollout_engine.config import EngineConfig

__all__ = ["ChildStart", "child_env", "spawn_child"]

# The child imports the same rollout_engine as this process, first on its path: a
# ``rollout_engine`` folder in the working directory must not shadow it (``python -m`` would
# put the working directory first).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD_BOOT = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from rollout_engine.runtime.child import main; sys.exit(main())")


@dataclass
class ChildStart:
    """The first message to the child: what to run and the parent's import path."""

    config: EngineConfig
    sys_path: list[str]
    tp: Any = None   # a tensor-parallel rank > 0: runtime.tp_launch.TPStart


def child_env() -> dict[str, str]:
    """This process's environment with the scheduler's defaults added (a value already set
    is kept, so TP ranks started by rank 0 get exactly rank 0's)."""
    env = dict(os.environ)
    # OpenMP's waits (the child reads these at import). Workers that spin for long (libgomp's
    # default: 300k spins, ~3 ms; ACTIVE: for good) made small decode matmuls ~5x slower when
    # the cores are shared (the frontend, a colocated trainer); purely passive ones sleep
    # after every parallel region, and the next one (a forward has ~150, a few us of Python
    # apart) waits for the futex wake-up: offline batch 64 ran at ~1,750 tok/s that way and
    # at ~2,400 with a short spin (10k spins, ~0.1 ms) first, batch 128 +15%, serving +5-10%
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("GOMP_SPINCOUNT", "10000")
    # oneDNN's primitive cache (models/layers.linear; keyed by shapes, ~5 a row count for a
    # decoder, ~0.7 MB each) is read once when torch loads, so only a child can set it.
    # linear buckets row counts (80 up to 256 rows, 16 an octave above), so its default
    # of 1024 holds every decode batch size and the common prefill lengths; a larger one
    # only lets the process keep more memory it will rarely reuse
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    # (no THP_MEM_ALLOC_ENABLE: the weights, the KV pool and the refit spares ask for huge
    # pages themselves, memory/huge_pages.py; torch's allocator would ask for every
    # activation of 2 MB or more too, and each then waits on the kernel compacting memory)
    return env


def spawn_child() -> tuple[subprocess.Popen, Connection]:
    """Start ``runtime.child.main`` in a fresh interpreter with ``child_env()``; return the
    process and this end of its socket pair. The caller sends ``ChildStart`` first; the child
    exits when this process does (end-of-file, or this process's pid going away)."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_BOOT, _PACKAGE_ROOT, str(theirs.fileno()),
             str(os.getpid())], pass_fds=[theirs.fileno()], env=child_env(),
            stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    return proc, Connection(ours.detach())
