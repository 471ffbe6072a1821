"""Engine and HTTP-client setups shared by several test modules' fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def thread_engine(model_path: str, **flags: Any) -> Iterator[Any]:
    """A thread-scheduler float32 CPU engine on ``model_path``; when the fixture using it is
    torn down, the KV integrity is checked and the engine shut down (``yield from`` it)."""
    from rollout_engine import Engine

    eng = Engine(model_path=model_path, scheduler_mode="thread", dtype="float32", device="cpu",
                 **flags)
    yield eng
    try:
        eng.check_integrity()
    finally:
        eng.shutdown()


def app_client(engine: Any) -> Iterator[Any]:
    """A Starlette TestClient over the HTTP app of ``engine`` (``yield from`` it)."""
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as c:
        yield c


def served_over_http(engine: Any) -> Iterator[str]:
    """``engine``'s HTTP app served by uvicorn on a free local port, in a thread; yields its
    URL and stops the server when closed (``yield from`` it). The socket listens before the
    server starts, so connections wait in its backlog: no start race."""
    import socket
    import threading

    import uvicorn

    from rollout_engine.entrypoints.http_server import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def colocated_refits(engine: Any, trainer: Any, cycles: int = 3) -> str:
    """The colocated RL loop on `engine` with tensor handles: `cycles` times refit, sleep (the
    weights released: the engine unmaps the trainer's shm), wake; then a last refit. Returns
    the path of the shm file behind `trainer`'s first weight (for lifetime checks)."""
    import os

    from trainer_bridge import WeightSyncer
    from trainer_bridge.bucketing import state_dict_items

    with WeightSyncer(engine, transport="tensor") as syncer:
        for step in range(cycles):
            syncer.sync(trainer, version=f"loop-{step}")
            engine.release_memory_occupation(["weights"])
            engine.resume_memory_occupation(["weights"])
        syncer.sync(trainer, version="loop-final")
    first = next(t for _, t in state_dict_items(trainer))
    handle = first.untyped_storage()._share_filename_cpu_()[1].decode()
    return os.path.join("/dev/shm", handle.lstrip("/"))
