"""A server started the way a vLLM user starts one: ``rollout-engine vllm-serve MODEL --port P
[flags]`` in a child process, healthy before it is handed out, stopped (and reaped) after."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from tests.rollout_engine.entrypoints.conftest import bound_socket


def free_port() -> int:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


def wait_healthy(url: str, proc: subprocess.Popen, path: str = "/health",
                 timeout: float = 120.0) -> None:
    """Until ``url + path`` answers 200; the process exiting first fails with its stderr (a
    file, so that a chatty server never blocks on a full pipe)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log = proc.stderr
            if log is not None:
                log.seek(0)
            raise AssertionError(f"exited with {proc.returncode}: "
                                 f"{log.read() if log is not None else ''}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy in {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@contextlib.contextmanager
def vllm_serve(model: str, *flags: str, count: int = 1) -> Iterator[list[str]]:
    """``count`` servers started at once (``vllm-serve model --port P *flags``); their URLs."""
    ports = [free_port() for _ in range(count)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "rollout_engine.entrypoints.cli", "vllm-serve", model,
         "--port", str(port), *flags],
        stdout=subprocess.DEVNULL, stderr=tempfile.TemporaryFile("w+"), text=True)
        for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        yield urls
    finally:
        for proc in procs:
            stop(proc)
            if proc.stderr is not None:
                proc.stderr.close()
