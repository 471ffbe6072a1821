"""The engine's HTTP server as a child of a verl server actor: its command line, built from
verl's rollout config, and the process (started, waited for, stopped).

The child runs ``python -m rollout_engine.integrations.verl.serve --parent-pid PID <flags>``:
``launch_server`` with every flag as given, ended as soon as the actor's process is gone (a
killed Ray actor leaves no server behind).
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import httpx

__all__ = ["ServerProcess", "engine_flags", "free_port"]

START_TIMEOUT_S = 600.0
"""How long a server may take to answer /health (loading a large checkpoint on a busy node)."""

_LOG_LINES = 40


def engine_flags(options: Mapping[str, Any]) -> list[str]:
    """``{"tp_size": 2, "enable_weights_cpu_backup": True, ...}`` -> launch_server's command
    line: ``--tp-size 2 --enable-weights-cpu-backup``. True is the switch, False its
    ``--no-`` form, None leaves the flag out, a list gives one value per item. Names are
    EngineConfig fields or SGLang server flags (launch_server refuses a name it does not know,
    naming it)."""
    argv: list[str] = []
    for name, value in options.items():
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"engine flag names are words like 'tp_size', got {name!r}")
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def free_port(host: str) -> int:
    """A port nobody listens on at ``host`` now (the server binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One ``launch_server`` child: started by `start`, healthy once `wait_healthy` returns,
    ended by `stop` (idempotent) or when the process that started it exits.

    Its stdout and stderr are kept (the last lines) so a failed start says why."""

    def __init__(self, flags: list[str], env: Optional[Mapping[str, str]] = None) -> None:
        self.flags = list(flags)
        self.env = dict(os.environ if env is None else env)
        self.proc: Optional[subprocess.Popen[str]] = None
        self._lines: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self._reader: Optional[threading.Thread] = None

    def start(self) -> None:
        root = str(Path(__file__).resolve().parents[3])   # the package root, first on the path
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, self.env.get("PYTHONPATH", "")) if p)
        argv = [sys.executable, "-m", "rollout_engine.integrations.verl.serve",
                "--parent-pid", str(os.getpid()), *self.flags]
        self.proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, args=(self.proc,),
                                        name="rollout-engine-server-log", daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line.rstrip("\n"))
            sys.stderr.write(line)   # the actor's log (Ray forwards it to the driver)

    def log_tail(self) -> str:
        return "\n".join(self._lines)

    def wait_healthy(self, url: str, timeout_s: float = START_TIMEOUT_S,
                     headers: Optional[Mapping[str, str]] = None) -> None:
        """Poll ``url``/health until it answers 200. Raises RuntimeError with the server's last
        output if the process exits first or ``timeout_s`` passes."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, headers=dict(headers or {})) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(f"rollout_engine server exited with code {code} before "
                                       f"it served; its last output:\n{self.log_tail()}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rollout_engine server did not answer {url}/health "
                                       f"within {timeout_s:.0f} s; its last output:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM (the server stops in order), then SIGKILL after ``timeout_s``; the exit
        code, or None if it was never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5.0)
        return self.proc.returncode
