"""SIGTERM stops the server process and its scheduler within a bound, even when the server's
event loop is blocked for good (as a deadlock on the loop's thread once left it); /health
answers without waiting on anything request handling holds."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest

from tests.rollout_engine.entrypoints.conftest import bound_socket
from tests.rollout_engine.entrypoints.test_launch_server import _wait_healthy

STOP_BOUND_S = 10.0
HEALTH_TIMEOUT_S = 2.0

# The real server entry point, with one extra route that blocks the event loop on a lock its
# own thread holds (the shape of a self-deadlock).
SERVER = textwrap.dedent("""
    import sys, threading
    from rollout_engine.entrypoints import http_server

    make_app = http_server.create_app

    def create_app(engine, **kw):
        app = make_app(engine, **kw)

        @app.post("/block_the_loop")
        async def block_the_loop():
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()

        return app

    http_server.create_app = create_app
    sys.exit(http_server.run_server({"model_path": sys.argv[1], "port": int(sys.argv[2]),
                                     "dtype": "float32", "device": "cpu"}))
""")


@pytest.fixture
def server(qwen2_path: str, tmp_path):
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, qwen2_path, str(port)],
                                stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout=300)   # a first start may build the C++ kernels
        yield proc, url, log
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            p.kill()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _stop_and_time(proc: subprocess.Popen, scheduler: psutil.Process) -> float:
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_BOUND_S)
        scheduler.wait(max(0.1, STOP_BOUND_S - (time.monotonic() - sent)))
    except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
        pytest.fail(f"the server or its scheduler still ran {STOP_BOUND_S:g} s after SIGTERM")
    return time.monotonic() - sent


def test_sigterm_stops_a_server_whose_event_loop_is_blocked(server) -> None:
    proc, url, log = server
    scheduler = psutil.Process(httpx.get(url + "/get_server_info").json()["scheduler_pid"])
    def block() -> None:
        try:
            httpx.post(url + "/block_the_loop", timeout=60)
        except httpx.HTTPError:
            pass   # the server goes away under it

    threading.Thread(target=block, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:   # until the loop stops answering: then it is blocked
        try:
            httpx.get(url + "/health", timeout=1.0)
        except httpx.TimeoutException:
            break
        assert time.monotonic() < deadline, "the loop never blocked"
    took = _stop_and_time(proc, scheduler)
    assert proc.returncode == 1, "a forced stop is not a clean exit"
    assert "killing the scheduler" in log.read_text()
    assert took < STOP_BOUND_S


def test_sigterm_stops_an_idle_server_cleanly(server) -> None:
    proc, url, _ = server
    scheduler = psutil.Process(httpx.get(url + "/get_server_info").json()["scheduler_pid"])
    _stop_and_time(proc, scheduler)
    assert proc.returncode == 0


def test_health_answers_while_every_worker_thread_is_busy(live_server, serve_app) -> None:
    """Sync routes and dependencies share one pool of worker threads (anyio's, 40); /health
    must not need one."""
    import anyio.to_thread

    from rollout_engine.entrypoints.http_server import create_app

    app = create_app(live_server.engine)
    async def pool_size() -> int:   # the default of every event loop's pool
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    workers = anyio.run(pool_size)
    inside = threading.Semaphore(0)
    release = threading.Event()

    @app.get("/occupy_a_worker")
    def occupy_a_worker() -> dict:
        inside.release()
        release.wait(60)
        return {}

    url = serve_app(app)
    threads = [threading.Thread(target=httpx.get, args=(url + "/occupy_a_worker",),
                                kwargs={"timeout": 90}, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        for _ in range(workers):
            assert inside.acquire(timeout=60)
        r = httpx.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
        assert r.status_code == 200
    finally:
        release.set()
        for t in threads:
            t.join(30)
