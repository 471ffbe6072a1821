"""The processes of ``bench_pd.py``'s three setups on two cores: our servers (this checkout's
``launch_server``) and the real sglang-router in PD mode, each started on free loopback ports
and returned once its ``/health`` answers; ``stop`` ends one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import common

_HERE = os.path.dirname(os.path.abspath(__file__))
SETUPS = ("pd", "colocated", "dp2")
DESCRIPTIONS = {
    "pd": "a prefill and a decode server, 1 thread each, sglang-router --pd-disaggregation",
    "colocated": "one server, 2 threads",
    "dp2": "one server --dp-size 2 (its own dispatcher), 1 thread per replica"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, what: str, log: str,
                  timeout_s: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (rc {proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not become healthy within {timeout_s:.0f} s; see {log}")


def _spawn(cmd: list[str], env: dict[str, str], log_name: str) -> tuple[subprocess.Popen, str]:
    log = os.path.join(common.RESULTS_DIR, log_name)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/")
    return proc, log


def start_server(model_dir: str, threads: int, context_len: int, extra: list[str], tag: str
                 ) -> tuple[subprocess.Popen, str]:
    """This checkout's server (``launch_server``) on a free port, ``threads`` torch / OpenMP
    threads; returns once ``/health`` answers."""
    port = _free_port()
    root = os.path.dirname(_HERE)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([root] + [p for p in os.environ.get(
               "PYTHONPATH", "").split(os.pathsep) if p])}
    cmd = [sys.executable, "-m", "rollout_engine.launch_server", "--model-path", model_dir,
           "--port", str(port), "--dtype", "float32", "--device", "cpu",
           "--num-threads", str(threads), "--random-seed", "0",
           "--context-length", str(context_len), "--max-running-requests", "64", *extra]
    proc, log = _spawn(cmd, env, f".pd_{tag}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, f"the {tag} server", log)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def router_python() -> Optional[str]:
    """The python of the venv holding sglang-router (built by the real-clients tests)."""
    cache = os.environ.get("ROLLOUT_ENGINE_CACHE", "/tmp")
    py = Path(cache) / "clients-venv" / "bin" / "python"
    return str(py) if py.exists() else None


def start_pd_router(prefill_url: str, bootstrap_port: int, decode_url: str
                    ) -> tuple[subprocess.Popen, str]:
    """sglang-router in PD mode in front of one prefill and one decode server."""
    py = router_python()
    if py is None:
        raise RuntimeError("no sglang-router venv (run tests/rollout_engine/entrypoints/"
                           "test_real_clients.py once to build it)")
    port = _free_port()
    cmd = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port),
           "--decode", decode_url, "--prometheus-port", str(_free_port()),
           "--worker-startup-timeout-secs", "60"]
    proc, log = _spawn(cmd, dict(os.environ), ".pd_router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, "the PD router", log, timeout_s=120)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_setup(setup: str, model_dir: str, context_len: int) -> tuple[list[subprocess.Popen],
                                                                       str]:
    """The processes of ``setup`` (last started first in the list) and the URL to load."""
    if setup == "colocated":
        proc, url = start_server(model_dir, 2, context_len, [], "colocated")
        return [proc], url
    if setup == "dp2":
        proc, url = start_server(model_dir, 1, context_len, ["--dp-size", "2"], "dp2")
        return [proc], url
    if setup != "pd":
        raise ValueError(f"unknown setup {setup!r}; one of {list(SETUPS)}")
    procs: list[subprocess.Popen] = []
    try:
        boot = _free_port()
        p, purl = start_server(model_dir, 1, context_len, [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)],
            "prefill")
        procs.insert(0, p)
        d, durl = start_server(model_dir, 1, context_len, ["--disaggregation-mode", "decode"],
                               "decode")
        procs.insert(0, d)
        r, url = start_pd_router(purl, boot, durl)
        procs.insert(0, r)
    except BaseException:
        for p in procs:
            stop(p)
        raise
    return procs, url
